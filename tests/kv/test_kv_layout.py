"""The cache layout (kv/layout.py) is what the cache allocates in every tier and what the memory plan, the cost
model, --dry-run and the evaluations count; per-channel keys pack 2/3/4/8 bits and survive a merge of values."""
from __future__ import annotations

import pytest
import torch

from flexh2o.compress.bits import pack, unpack
from flexh2o.compress.codec import assign, expand
from flexh2o.config import from_name
from flexh2o.kv.cache import KVBlock
from flexh2o.kv.layout import CacheLayout, CacheQuant
from test_kv_equivalence import _rc

QUANTS = [None, CacheQuant(4, 16, "token"), CacheQuant(4, 16, "channel", 2), CacheQuant(3, 16, "channel", 1),
          CacheQuant(2, 16, "token"), CacheQuant(3, 16, "fitted", 1)]


def test_layout_bytes_by_hand():
    """b 2, 3 KV heads, 10 slots, head_dim 64, fp16, 4 bits, 4 outliers: a key slot 32 + 4 + 8 bytes, a value slot
    32 + 4, a row and head's calibration 64 x 2 x 2; pos 8 and score 4 bytes a slot."""
    lay = CacheLayout(2, 3, 10, 64, torch.float16, CacheQuant(4, 64, "channel", 4))
    assert lay.kv_slot_bytes() == 44 + 36 and lay.kv_row_bytes() == 256
    assert lay.nbytes == 60 * (44 + 36 + 12) + 6 * 256
    tok = CacheLayout(2, 3, 10, 64, torch.float16, CacheQuant(3, 64, "token"))
    assert tok.kv_slot_bytes() == 2 * (24 + 4) and tok.kv_row_bytes() == 0
    assert CacheLayout(2, 3, 10, 64, torch.float16).nbytes == 60 * (256 + 12)
    fit = CacheLayout(2, 3, 10, 64, torch.float16, CacheQuant(3, 64, "fitted", 4))  # 8 levels a channel, fp16
    assert fit.kv_slot_bytes() == (24 + 4 + 8) + (24 + 4) and fit.kv_row_bytes() == 64 * 8 * 2


@pytest.mark.parametrize("tier", ["gpu", "cpu", "disk"])
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.describe() if q else "plain")
def test_cache_takes_the_layout_bytes_in_every_tier(tier, quant, offload_dir):
    from flexh2o.engine import Engine
    from flexh2o.kv.cache import KVCache
    rc = _rc("opt", "h2o", offload_dir, [100, 0, 0, 0]).with_(compress_cache=quant)
    with Engine(rc) as eng:
        before = eng.tiers[tier].used
        cfg = rc.model
        cache = KVCache(eng.tiers, [[tier] * rc.num_gpu_batches] * cfg.num_layers, rc.gpu_batch_size,
                        cfg.kv_heads, rc.cache_slots(), cfg.head_dim, rc.dtype, quant)
        used = eng.tiers[tier].used - before
        cache.close()
        assert eng.tiers[tier].used == before
    assert used == rc.num_gpu_batches * cfg.num_layers * CacheLayout.of_run(rc).nbytes


@pytest.mark.parametrize("quant", QUANTS[1:], ids=lambda q: q.describe())
def test_plan_and_cost_model_count_the_layout(quant, offload_dir):
    from flexh2o.planning.memory_plan import cache_block_bytes, plan_memory
    from flexh2o.tuning.step_cost import StepCost as _Model
    from flexh2o.tuning.hardware import Rates, load_profile
    rc = _rc("opt", "h2o", offload_dir, [100, 0, 100, 0]).with_(compress_cache=quant)
    lay = CacheLayout.of_run(rc)
    assert cache_block_bytes(rc) == lay.nbytes < cache_block_bytes(rc.with_(compress_cache=None))
    assert plan_memory(rc).bytes["gpu"]["cache"] == lay.nbytes * rc.model.num_layers * rc.num_gpu_batches
    model = _Model(rc, Rates.from_profile(load_profile("cpu_measured"), rc.compute))
    assert model.block == lay.nbytes and model.block_files == len(lay.parts())
    assert model.slot_kv == lay.kv_slot_bytes() + lay.kv_row_bytes()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_levels_pack_and_unpack(bits):
    q = torch.randint(0, 1 << bits, (3, 4, 16), dtype=torch.uint8)
    data = pack(q, bits)
    assert data.shape == (3, 4, 16 * bits // 8) and torch.equal(unpack(data, bits, 16), q)
    ones = torch.zeros(1, 8, dtype=torch.uint8)
    ones[0, 1] = (1 << bits) - 1  # value 1: bits [bits, 2 bits) of the stream
    stream = int.from_bytes(bytes(pack(ones, bits)[0].tolist()), "little")
    assert stream == ((1 << bits) - 1) << bits


def test_channel_keys_calibrate_on_the_prompt_and_clamp_later_tokens():
    blk = KVBlock.empty(1, 1, 4, 8, torch.float32, "cpu", CacheQuant(2, 8, "channel", 1))
    prompt = torch.tensor([[0.0, 0, 0, 0, 0, 0, 0, 0], [3.0, 3, 3, 3, 3, 3, 3, 3]]).view(1, 1, 2, 8)
    blk.calibrate(prompt, torch.ones(1, 1, 2, dtype=torch.bool))  # every channel: minimum 0, step 1
    assign(blk.k, (slice(None), slice(None), slice(0, 2)), prompt)
    later = torch.tensor([0.4, 1.6, 2.2, 9.0, -5.0, 3.0, 0.0, 1.0]).view(1, 1, 8)
    assign(blk.k, (torch.tensor([[0]]), torch.tensor([[0]]), torch.tensor([[2]])), later)
    got = expand(blk.k, torch.float32)[0, 0]
    assert torch.equal(got[:2], prompt[0, 0])
    # levels 0 2 2 3 0 3 0 1; the largest error (9 -> 3) is kept exact
    assert got[2].tolist() == [0.0, 2.0, 2.0, 9.0, 0.0, 3.0, 0.0, 1.0]


def test_merge_on_a_channel_block_changes_values_only():
    g = torch.Generator().manual_seed(0)
    blk = KVBlock.empty(1, 2, 4, 8, torch.float32, "cpu", CacheQuant(4, 8, "channel", 1))
    keys, vals = torch.randn(1, 2, 4, 8, generator=g), torch.randn(1, 2, 4, 8, generator=g)
    blk.calibrate(keys, torch.ones(1, 2, 4, dtype=torch.bool))
    assign(blk.k, (slice(None),) * 3, keys)
    assign(blk.v, (slice(None),) * 3, vals)
    blk.pos[:] = torch.arange(4)
    blk.written = torch.tensor([[3, 1]])
    k0, v0 = expand(blk.k, torch.float32), expand(blk.v, torch.float32)
    blk.merge(torch.tensor([[[-1, -1, 0, -1], [-1, -1, -1, -1]]]), torch.ones(1, 2, 4))
    assert torch.equal(expand(blk.k, torch.float32), k0)
    v1 = expand(blk.v, torch.float32)
    assert not torch.equal(v1[0, 0, 0], v0[0, 0, 0]) and torch.equal(v1[0, 1], v0[0, 1])
    torch.testing.assert_close(v1[0, 0, 0], (v0[0, 0, 0] + v0[0, 0, 2]) / 2, atol=0.2, rtol=0)


def test_mission_dry_run_with_channel_keys_reports_the_larger_batch(capsys):
    from flexh2o.cli import run as cli

    def batch(extra):
        assert cli.main(["--model", "opt-30b", "--percent", "0", "100", "100", "0", "--hh-ratio", "0.2",
                         "--gpu-mem", "16GB", "--cpu-mem", "200GB", "--dry-run"] + extra) == 0
        out = capsys.readouterr().out
        line = [ln for ln in out.splitlines() if ln.startswith("largest --gpu-batch-size")][0]
        return out, {k: int(v) for k, v in (p.split() for p in line.split(": ")[1].split(", "))}
    _, plain = batch([])
    out, packed = batch(["--compress-cache", "--cache-keys", "channel"])
    assert "keys per channel" in out
    assert packed["h2o"] > plain["h2o"] and packed["full"] > plain["full"], (plain, packed)


def test_weights_refuse_cache_only_widths(capsys):
    from flexh2o.cli import run as cli
    assert cli.main(["--model", "opt-125m", "--compress-weight", "--compress-bits", "3", "--dry-run"]) == 2
    assert "--compress-bits 3" in capsys.readouterr().err


def test_lane_passes_count_the_quantized_layout():
    from flexh2o.config import ModelConfig
    from flexh2o.eval.common import EvalModel, lane_passes
    cfg = ModelConfig("t", "llama", hidden=128, num_layers=2, num_heads=2, num_kv_heads=2, ffn=256, vocab=100,
                      max_positions=4096)
    lanes = [("h2o", 64), ("h2o", 65), ("h2o", 66), ("h2o", 67)]
    one = CacheLayout(4, 2, 68, 64, torch.float32).nbytes * 2  # a lane's two layers at 67 + 1 slots, unquantized
    plain = EvalModel("x", cfg, None, torch.float32)
    packed = EvalModel("x", cfg, None, torch.float32, compress_cache=CacheQuant(4, 64, "channel"))
    assert len(lane_passes(plain, lanes, 64, 32, 4, 2.5 * one)) > len(lane_passes(packed, lanes, 64, 32, 4, 2.5 * one))


@pytest.mark.parametrize("flags", [["--compress-cache", "--cache-keys", "channel", "--key-outliers", "2",
                                    "--compress-bits", "3"],
                                   ["--compress-cache", "--cache-keys", "fitted", "--key-outliers", "2"],
                                   ["--compress-cache", "--cache-keys", "token", "--compress-bits", "2"]])
def test_printed_command_line_reads_back_the_cache_quantization(flags):
    from flexh2o.cli import run as run_cli
    from flexh2o.tuning.search import command_line
    base = ["--model", "opt-125m", "--gpu-mem", "1GB", "--cpu-mem", "2GB", "--disk-mem", "4GB"]
    rc = run_cli.build_run_config(run_cli.build_parser().parse_args(base + flags), from_name("opt-125m"), None)
    line = command_line(rc).split()
    back = run_cli.build_run_config(run_cli.build_parser().parse_args(line[1:]), rc.model, None)
    assert back.compress_cache == rc.compress_cache and rc.compress_cache.keys == flags[2]


def test_fitted_levels_follow_the_prompt_not_its_range():
    """Fitted key levels (--cache-keys fitted): a channel whose prompt values crowd in 4.0-4.5 between two far ones
    (0 and 10) gets a level at their mean (4.25), so they read back within 0.25, where 4 evenly spaced levels over
    0-10 (0, 3.33, 6.67, 10) leave 4.5 1.17 away."""
    prompt = torch.tensor([0.0, 4.0, 4.1, 4.2, 4.3, 4.4, 4.5, 10.0]).view(1, 1, 8, 1).expand(1, 1, 8, 4)
    valid = torch.ones(1, 1, 8, dtype=torch.bool)
    errs = {}
    for keys in ("channel", "fitted"):
        blk = KVBlock(**CacheLayout(1, 1, 8, 4, torch.float32, CacheQuant(2, 4, keys, 0)).empty("cpu"))
        blk.calibrate(prompt, valid)
        assign(blk.k, (slice(None), slice(None), slice(0, 8)), prompt)
        errs[keys] = float((expand(blk.k, torch.float32) - prompt).abs().max())
    assert errs["fitted"] <= 0.25 + 1e-6 and errs["channel"] > 1.1


def test_three_bit_levels_unpack_as_the_bit_stream_says():
    """Random bytes read as the module's little-endian stream, value i at bits [3i, 3i + 3), by Python integers."""
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (5, 2, 24), dtype=torch.uint8, generator=g)
    got = unpack(data, 3, 64)
    for row, levels in zip(data.view(-1, 24).tolist(), got.view(-1, 64).tolist()):
        stream = int.from_bytes(bytes(row), "little")
        assert levels == [(stream >> (3 * i)) & 7 for i in range(64)]


def test_decode_read_bytes_by_hand():
    """What decode holds to read a block besides its logits (CacheLayout.read_bytes): b 2, 3 KV heads, 10 slots,
    head_dim 64. Plain in the compute dtype: nothing; plain fp16 read in fp32: K and V expanded, 2 x 60 x 64 x 4.
    Quantized (4 bits, keys per channel with 4 exact, values in groups of 64) read from its packed bytes: its fp16
    parts other than the packed levels as fp32 copies: the key outliers' exact values 60 x 4 (their index is read as
    stored), the keys' calibration 6 x 64 x 2, the values' scale and minimum 60 x 2: 1128 values, 4512 bytes; stored
    in fp32, nothing; read by the levels read (not packed): the expanded copy."""
    expanded = 2 * 60 * 64 * 4
    assert CacheLayout(2, 3, 10, 64, torch.float32).read_bytes(torch.float32, True) == 0
    assert CacheLayout(2, 3, 10, 64, torch.float16).read_bytes(torch.float32, True) == expanded
    quant = CacheLayout(2, 3, 10, 64, torch.float16, CacheQuant(4, 64, "channel", 4))
    assert quant.read_bytes(torch.float32, True) == 1128 * 4
    assert CacheLayout(2, 3, 10, 64, torch.float32, quant.quant).read_bytes(torch.float32, True) == 0
    assert quant.read_bytes(torch.float32, False) == expanded
    # an eviction policy's fp32 keys / values: a copy each unless stored as plain fp32
    assert CacheLayout(2, 3, 10, 64, torch.float32).policy_copy_bytes(True, True) == 0
    assert quant.policy_copy_bytes(False, True) == expanded // 2 and quant.policy_copy_bytes(True, True) == expanded


@pytest.mark.parametrize("mode", ["auto", "torch"])
def test_plan_holds_an_expanded_block_only_where_decode_expands(mode, monkeypatch, offload_dir):
    """The memory plan's compute-side buffers count the quantized block expanded only where decode reads it by the
    levels read (FLEXH2O_CACHE_KERNEL=torch, or no numba); read from its packed bytes, only its small parts. The
    cost model reads the same answer (fused_attend.reads_packed)."""
    from flexh2o.compress import fused_attend
    from flexh2o.planning.memory_plan import working_bytes
    from flexh2o.tuning.hardware import Rates, load_profile
    from flexh2o.tuning.step_cost import StepCost
    monkeypatch.setenv(fused_attend.ENV, mode)
    quant = CacheQuant(4, 16, "channel", 4, 8, 2, True)  # the tiny model's head_dim 16: values in one whole group
    rc = _rc("opt", "full", offload_dir, [100, 0, 100, 0]).with_(compress_cache=quant)
    packed = fused_attend.reads_packed(quant, "cpu", rc.model.head_dim)
    assert packed == (mode == "auto" and fused_attend.expected())
    if mode == "auto" and not packed:
        pytest.skip("numba is not installed: decode reads by the levels read")
    lay = CacheLayout.of_run(rc)
    plain = working_bytes(rc.with_(compress_cache=None))  # the same run, its block plain (fp32, read as stored)
    held = lay.expanded_bytes(rc.compute) if mode == "torch" else lay.read_bytes(rc.compute, True)
    assert mode == "torch" or held < lay.expanded_bytes(rc.compute)
    assert working_bytes(rc) - lay.nbytes == plain - CacheLayout.of_run(rc.with_(compress_cache=None)).nbytes + held
    assert StepCost(rc, Rates.from_profile(load_profile("cpu_measured"), rc.compute)).fused == packed


@pytest.mark.parametrize("head_dim, group, whole", [(64, 32, True), (64, 64, True), (48, 32, False), (16, 32, False)])
def test_reads_packed_only_heads_in_whole_groups(head_dim, group, whole, monkeypatch):
    """A block whose head_dim is not a whole number of groups (48 in 32s; 16 under a group of 32: a ragged tail)
    is read by the levels read, expanded (codec's whole_groups): fused_attend.reads_packed, the one answer that the
    memory plan and the cost model read, says so; so does the codec itself for a block of that shape."""
    from flexh2o.compress import fused_attend
    from flexh2o.compress.codec import CompressionSpec, quantize
    monkeypatch.setenv(fused_attend.ENV, "auto")
    if not fused_attend.expected():
        pytest.skip("numba is not installed: no block is read from its packed bytes")
    quant = CacheQuant(4, group, "token", 0)
    assert fused_attend.reads_packed(quant, "cpu", head_dim) == whole
    assert not fused_attend.reads_packed(None, "cpu", head_dim)
    values = torch.randn(1, 2, 5, head_dim, generator=torch.Generator().manual_seed(0))
    ct = quantize(values, CompressionSpec(bits=4, group_size=group, group_dim=3))
    assert ct.whole_groups() == whole
