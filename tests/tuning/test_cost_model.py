"""Cost model and policy search: hand-computed cases on a toy model and a round-number hardware profile."""
import json
import os

import pytest
import torch

from flexh2o.config import ModelConfig
from flexh2o.tuning.cost_model import OPS, contended, predict
from flexh2o.kv.policies import Budget
from flexh2o.kv.spec import KVSpec
from flexh2o.planning.memory_plan import plan_memory
from flexh2o.placement import Percent
from flexh2o.tuning.hardware import Rates
from flexh2o.run_config import RunConfig
from flexh2o.cli.plan import main as plan_main
from flexh2o.tuning.search import command_line, search

HW_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "flexh2o", "configs", "hardware")
FAST = 1e18  # a rate that makes its term vanish

# hidden 1024 so every fp32 tensor is a multiple of 4096 bytes (the disk tier pads files to that): no padding
TOY = ModelConfig("toy", "opt", hidden=1024, num_layers=2, num_heads=8, ffn=4096, vocab=512, max_positions=126)
# elements per layer (OPT):
#   embed  tokens 512*1024 + positions (126+2)*1024                                   =    655,360
#   block  4 attention mats 4*1024^2 + fc1/fc2 2*4096*1024 = 12,582,912 in matrices
#          + 4 attention biases 4*1024 + 2 LayerNorms 4*1024 + fc1 bias 4096 + fc2 bias 1024 = 12,596,224
#   head   final LayerNorm 2*1024 + tokens 512*1024 (tied; loaded again)               =    526,336
# one step loads 655,360 + 2*12,596,224 + 526,336 = 26,374,144 elements = 105,496,576 bytes in fp32
STEP_WEIGHT_BYTES = 105_496_576


def hw(**rates) -> dict:
    """Every rate FAST and no per-op overhead, except the ones given."""
    base = {"name": "toy", "device": "cpu", "matmul_flops": FAST, "decode_matmul_flops": FAST,
            "attention_flops": FAST, "decode_attention_flops": FAST, "cpu_mem_bw": FAST, "gpu_mem_bw": FAST,
            "convert_bw": FAST, "disk_read_bw": FAST, "disk_write_bw": FAST, "cpu_flops": FAST, "op_overhead_s": 0.0}
    base.update(rates)
    return base


def toy_rc(percent=(100, 0, 100, 0, 100, 0), b=4, nb=1, **kw) -> RunConfig:
    kw = {"prompt_len": 64, "gen_len": 8, "dtype": torch.float32, "gpu_mem": 1 << 30, "cpu_mem": 1 << 30,
          "disk_mem": 1 << 30, **kw}
    return RunConfig(model=TOY, percent=Percent(*percent), gpu_batch_size=b, num_gpu_batches=nb, **kw)


def test_overlap_takes_the_max_and_serial_the_sum():
    # weights on disk at 1e8 B/s: every layer reads its weights once per step -> 105,496,576 / 1e8 = 1.05496576 s
    # decode matmuls at 1e9 FLOP/s, batch 4: 2 * 4 * (2 * 12,582,912 + 512*1024 head) = 205,520,896 FLOP = 0.2055 s
    # every layer is disk-bound (block: 0.504 s of disk vs 0.101 s of matmul), so overlap = the disk time
    profile = hw(disk_read_bw=1e8, decode_matmul_flops=1e9)
    rc = toy_rc((0, 0, 100, 0, 100, 0))
    overlapped = predict(rc, profile)
    serial = predict(rc.with_(overlap=False), profile)
    assert overlapped.decode_s_per_token == pytest.approx(1.05496576, rel=1e-6)
    assert serial.decode_s_per_token == pytest.approx(1.05496576 + 0.205520896, rel=1e-6)
    assert overlapped.terms["decode"]["disk.weights_read"] == pytest.approx(STEP_WEIGHT_BYTES / 1e8)
    assert overlapped.bottleneck["decode"] == "disk"
    # prefill reads the same weights and runs its matmuls at matmul_flops (FAST), except the head, which sees one
    # token per sequence: 2 * 4 * 524,288 / 1e9 = 0.0041943 s, hidden under the head's disk read when overlapped
    assert overlapped.prefill_s == pytest.approx(1.05496576, rel=1e-6)
    assert serial.prefill_s == pytest.approx(1.05496576 + 0.004194304, rel=1e-6)


def test_throughput_is_generated_tokens_over_prefill_plus_decode():
    p = predict(toy_rc((0, 0, 100, 0, 100, 0), b=4, nb=2), hw(disk_read_bw=1e8))
    assert p.decode_s == pytest.approx(7 * p.decode_s_per_token)  # gen_len 8: the 7 tokens after the first
    assert p.total_s == pytest.approx(p.prefill_s + p.decode_s)
    assert p.total_throughput == pytest.approx(8 * 8 / p.total_s)  # 8 sequences x 8 tokens
    assert p.prefill_throughput == pytest.approx(8 * 64 / p.prefill_s)
    assert p.decode_throughput == pytest.approx(8 * 7 / p.decode_s)


def test_more_gpu_batches_amortise_weight_io():
    # disk-bound: 4 GPU batches share one weight load per layer, so a step costs the same 1.055 s for 4x the tokens
    profile = hw(disk_read_bw=1e8)
    one = predict(toy_rc((0, 0, 100, 0, 100, 0), b=4, nb=1), profile)
    four = predict(toy_rc((0, 0, 100, 0, 100, 0), b=4, nb=4), profile)
    assert four.decode_s_per_token == pytest.approx(one.decode_s_per_token, rel=1e-6)
    assert four.decode_throughput == pytest.approx(4 * one.decode_throughput, rel=1e-6)


def test_h2o_slots_shrink_the_cache_terms():
    # cache on disk, read and rewritten whole every decode step: 2 layers x (read + write) per token
    # block = b 4 x kv heads 8 x slots S x (K, V: 2 x 128 x 4 B, pos 8 B, score 4 B); files padded to 4096
    #   full  S = 64 + 8 = 72: K = V = 1,179,648; pos 18,432 -> 20,480; score 9,216 -> 12,288; block 2,392,064 B
    #   h2o   S = 8 + 8 + 1 = 17: K = V = 278,528; pos 4,352 -> 8,192; score 2,176 -> 4,096;   block 569,344 B
    profile = hw(disk_read_bw=1e8, disk_write_bw=1e8)
    full = predict(toy_rc((100, 0, 0, 0, 100, 0)), profile)
    h2o = predict(toy_rc((100, 0, 0, 0, 100, 0), kv=KVSpec("h2o", Budget(8, 8))), profile)
    assert full.decode_s_per_token == pytest.approx(4 * 2_392_064 / 1e8, rel=1e-6)
    assert h2o.decode_s_per_token == pytest.approx(4 * 569_344 / 1e8, rel=1e-6)
    assert h2o.terms["decode"]["disk.cache_read"] == pytest.approx(2 * 569_344 / 1e8)


def test_disk_weights_are_slower_than_cpu_weights():
    profile = hw(disk_read_bw=1e9, cpu_mem_bw=1e10, decode_matmul_flops=1e11, matmul_flops=1e11)
    cpu = predict(toy_rc((0, 100, 100, 0, 100, 0)), profile)
    disk = predict(toy_rc((0, 0, 100, 0, 100, 0)), profile)
    assert disk.total_s > cpu.total_s
    t4 = _load("t4_paper.json")
    gpu_rc = toy_rc(device="cuda", dtype=torch.float16)
    on_cpu = predict(gpu_rc.with_(percent=Percent(0, 100, 100, 0, 100, 0)), t4)
    on_disk = predict(gpu_rc.with_(percent=Percent(0, 0, 100, 0, 100, 0)), t4)
    assert on_disk.decode_s_per_token > on_cpu.decode_s_per_token
    assert on_cpu.terms["decode"]["h2d.weights"] == pytest.approx(STEP_WEIGHT_BYTES / 2 / t4["h2d_bw"])


def test_cpu_cache_compute_moves_attention_to_the_host():
    t4 = _load("t4_paper.json")
    rc = toy_rc((100, 0, 0, 100, 100, 0), device="cuda", dtype=torch.float16)
    moved = predict(rc, t4).terms["decode"]
    kept = predict(rc.with_(cpu_cache_compute=True), t4).terms["decode"]
    assert "h2d.cache" in moved and "compute.cpu_attention" not in moved
    assert "h2d.cache" not in kept and kept["compute.cpu_attention"] > 0


def test_quantized_cache_read_fused_costs_its_packed_bytes_not_an_expansion(monkeypatch):
    # decode attention over a 4-bit cache block, memory-resident: expanded (FLEXH2O_CACHE_KERNEL=torch), K and V are
    # made in fp32 first, 2 * b * kv * slots * head_dim * 4 B * EXPAND_PASSES at convert_bw; read fused from the
    # packed bytes (compress/fused_attend.py), the block is read once at the memory rate instead
    pytest.importorskip("numba")
    from flexh2o.compress.fused_attend import ENV
    from flexh2o.kv.cache_quant import CacheQuant
    from flexh2o.kv.layout import CacheLayout
    from flexh2o.tuning.kernel_cost import EXPAND_PASSES
    profile = hw(cpu_mem_bw=1e9, gpu_mem_bw=1e9, convert_bw=1e8)
    rc = toy_rc(compress_cache=CacheQuant())
    monkeypatch.setenv(ENV, "torch")
    expanded = predict(rc, profile).terms["decode"]["compute.attention"]
    monkeypatch.setenv(ENV, "auto")
    fused = predict(rc, profile).terms["decode"]["compute.attention"]
    layouts = CacheLayout.layers_of_run(rc)
    b, kv, d = 4, TOY.kv_heads, TOY.head_dim
    expand = sum(2 * b * kv * lay.slots * d * 4 * EXPAND_PASSES / 1e8 for lay in layouts)
    packed = sum(lay.nbytes / 1e9 for lay in layouts)
    assert expanded - fused == pytest.approx(expand - packed, rel=1e-9)
    assert fused < expanded


@pytest.mark.parametrize("name", ["t4_paper.json", "a100_80gb.json", "cpu_measured.json"])
def test_shipped_profiles_predict(name):
    profile = _load(name)
    device = "cuda" if profile["device"] == "cuda" else "cpu"
    p = predict(toy_rc(device=device, dtype=torch.float16 if device == "cuda" else torch.bfloat16), profile)
    assert p.total_throughput > 0 and "sources" in profile or "command" in profile


def test_missing_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="float32"):
        predict(toy_rc(), hw(matmul_flops={"bfloat16": 1e12}))


def test_matmul_rate_by_rows_is_interpolated_in_log_rows():
    # table 1 -> 1e9, 4 -> 3e9, 16 -> 4e9 FLOP/s; rows 2 is halfway between 1 and 4 in log2: 2e9
    table = {"float32": {"1": 1e9, "4": 3e9, "16": 4e9}}
    r = Rates.from_profile(hw(matmul_flops_by_rows=table), torch.float32)
    assert [r.matmul_rate(n, prefill=False) for n in (1, 2, 4, 8, 16)] == pytest.approx([1e9, 2e9, 3e9, 3.5e9, 4e9])
    assert r.matmul_rate(1000, prefill=True) == 4e9  # clamped to the table's ends
    # decode of the toy, weights in memory, batch 2 (rows 2 -> 2e9 FLOP/s): blocks 2 x 2 x 2 x 12,582,912 FLOP
    # + head 2 x 2 x 524,288 = 102,760,448 FLOP -> 0.051380224 s
    p = predict(toy_rc(b=2), hw(matmul_flops_by_rows=table))
    assert p.terms["decode"]["compute.matmul"] == pytest.approx(102_760_448 / 2e9)
    # without a table: the single decode figure, as before
    assert predict(toy_rc(b=2), hw(decode_matmul_flops=2e9)).terms["decode"]["compute.matmul"] == \
        pytest.approx(102_760_448 / 2e9)
    with pytest.raises(ValueError, match="matmul_flops_by_rows for float32"):
        Rates.from_profile(hw(matmul_flops_by_rows={"bfloat16": {"1": 1e9}}), torch.float32)


def test_contended_overlap_hand_computed():
    # 1 s of disk and 0.5 s of compute, both 2x slower while they share the cores: compute ends at 1.0 s having
    # let the disk do half its work; the other half takes 0.5 s at the idle rate -> 1.5 s
    assert contended(1.0, 0.5, 2.0, 2.0) == pytest.approx(1.5)
    assert contended(0.5, 1.0, 2.0, 2.0) == pytest.approx(1.5)  # symmetric
    assert contended(1.0, 0.5, 1.0, 1.0) == pytest.approx(1.0)  # no slowdown: plain overlap, the max
    assert contended(1.0, 1.0, 1.0, 1.0) == pytest.approx(1.0)


def test_cpu_overlap_uses_the_busy_rates():
    # weights on disk (105,496,576 B per step), idle 1e8 B/s, busy 5e7 B/s (2x); compute 2x slower while reading.
    # Layer by layer: disk D = bytes / 1e8, compute C = matmul FLOP / 1e9 (batch 4, decode, as in the first test);
    # each block: D = 0.50385 s, C = 0.100663 s -> contended = 2C + (1 - 2C/2D) D = D + C = 0.604516 s
    profile = hw(disk_read_bw=1e8, disk_read_bw_busy=5e7, compute_busy=0.5, decode_matmul_flops=1e9)
    rc = toy_rc((0, 0, 100, 0, 100, 0))
    p = predict(rc, profile)
    plain = predict(rc, hw(disk_read_bw=1e8, decode_matmul_flops=1e9))
    block_d, block_c = 4 * 12_596_224 / 1e8, 2 * 4 * 12_582_912 / 1e9
    head_d, head_c = 4 * 526_336 / 1e8, 2 * 4 * 524_288 / 1e9
    embed_d = 4 * 655_360 / 1e8  # the embedding's lookup does no matmul: disk alone
    want = embed_d + 2 * (block_d + block_c) + (head_d + head_c)
    assert p.decode_s_per_token == pytest.approx(want, rel=1e-6)
    assert plain.decode_s_per_token == pytest.approx(STEP_WEIGHT_BYTES / 1e8, rel=1e-6)
    # no overlap: no sharing to model, the plain sum
    assert predict(rc.with_(overlap=False), profile).decode_s_per_token == \
        pytest.approx(predict(rc.with_(overlap=False), hw(disk_read_bw=1e8, decode_matmul_flops=1e9))
                      .decode_s_per_token)


def test_ops_over_the_parallel_grain_cost_a_thread_wake_up():
    # toy hidden 1024: a decode batch of 31 (31,744 elements) stays under torch's grain of 32,768; 32 reaches it
    profile = hw(op_overhead_s=1e-5, parallel_op_s=5e-5)
    small = predict(toy_rc(b=31), profile).terms["decode"]["compute.overhead"]
    big = predict(toy_rc(b=32), profile).terms["decode"]["compute.overhead"]
    ops = OPS["embed"] + 2 * OPS["block"] + OPS["head"]  # full policy: no eviction ops
    assert small == pytest.approx(ops * 1e-5)
    assert big == pytest.approx(ops * 5e-5)


def test_search_keeps_only_fitting_plans_and_beats_a_naive_one():
    profile = hw(disk_read_bw=1e9, disk_write_bw=1e9, cpu_mem_bw=1e10, decode_matmul_flops=1e11, matmul_flops=1e11,
                 op_overhead_s=1e-5)
    base = toy_rc(gpu_mem=160 << 20, cpu_mem=64 << 20, disk_mem=1 << 30)  # weights alone are 98.6 MiB
    results = search(base, profile, step=50, max_num_gpu_batches=4, limit=10)
    assert results
    for rc, pred in results:
        assert plan_memory(rc).overflow() is None
    tps = [p.total_throughput for _, p in results]
    assert tps == sorted(tps, reverse=True)
    naive = base.with_(percent=Percent(0, 0, 0, 0, 100, 0), gpu_batch_size=1)
    assert plan_memory(naive).overflow() is None
    assert tps[0] > predict(naive, profile).total_throughput


def test_search_max_seqs_caps_the_sequences_in_flight():
    profile = hw(disk_read_bw=1e9, disk_write_bw=1e9, cpu_mem_bw=1e10, decode_matmul_flops=1e11, matmul_flops=1e11,
                 op_overhead_s=1e-5)
    base = toy_rc(gpu_mem=160 << 20, cpu_mem=64 << 20, disk_mem=1 << 30)
    free = search(base, profile, step=50, max_num_gpu_batches=4, limit=50)
    capped = search(base, profile, step=50, max_num_gpu_batches=4, limit=50, max_seqs=6)
    assert max(rc.num_seqs for rc, _ in free) > 6  # the cap binds here
    assert capped and all(rc.num_seqs <= 6 for rc, _ in capped)
    assert max(rc.num_seqs for rc, _ in capped) >= 4  # it still fills the cap as far as the batch sizes allow


@pytest.mark.parametrize("nb", [1, 3])
@pytest.mark.parametrize("percent", [(100, 0, 100, 0, 100, 0), (30, 50, 20, 40, 0, 100), (0, 0, 0, 0, 0, 0)])
def test_search_memory_arithmetic_matches_plan_memory(percent, nb):
    # the search builds placements through a shared memo; they must be the placements (and plans) of a fresh config
    from flexh2o.models import layer_specs
    from flexh2o.placement import Placement
    base = toy_rc(kv=KVSpec("h2o", Budget(8, 8)))
    memo: dict = {}
    for b in (1, 5, 32):
        rc = base.with_(percent=Percent(*percent), gpu_batch_size=b, num_gpu_batches=nb)
        placed = rc.placed(Placement.build(layer_specs(TOY), rc.percent, nb, memo))
        assert placed.placement == rc.placement
        assert plan_memory(placed).bytes == plan_memory(rc).bytes


def test_command_line_parses_back():
    rc = toy_rc((20, 80, 0, 100, 0, 100), b=48, nb=3, kv=KVSpec("h2o", Budget(12, 12)),
                cpu_cache_compute=True).with_(model=_named("opt-125m"))
    cmd = command_line(rc).split()
    i = cmd.index("--percent")
    assert Percent.parse(cmd[i + 1:i + 7]) == rc.percent
    cli = pytest.importorskip("flexh2o.cli.run")
    args = cli.build_parser().parse_args(cmd[1:] + ["--device", "cpu"])
    back = cli.build_run_config(args, rc.model, None)
    for field in ("percent", "gpu_batch_size", "num_gpu_batches", "prompt_len", "gen_len", "cpu_cache_compute",
                  "kv", "dtype", "gpu_mem", "cpu_mem", "disk_mem", "overlap"):
        assert getattr(back, field) == getattr(rc, field), field


def test_plan_cli(tmp_path, capsys):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(hw(disk_read_bw=1e9, decode_matmul_flops=1e11)))
    argv = ["--model", "opt-125m", "--prompt-len", "32", "--gen-len", "4", "--hardware", str(path), "--gpu-mem",
            "1GB", "--cpu-mem", "2GB", "--disk-mem", "4GB", "--step", "50", "--max-num-gpu-batches", "2"]
    # --exact-ratio: a quarter of a 32-token prompt is 16 tokens, under the ratio floor that a plain --hh-ratio keeps
    assert plan_main(argv + ["--hh-ratio", "0.25", "--exact-ratio"]) == 0
    out = capsys.readouterr().out
    assert "flexh2o-run --model opt-125m --percent" in out and "--kv-budget 16" in out
    for bad in (["--model", "opt-1t"], ["--gpu-mem", "lots"], ["--hardware", str(tmp_path / "none.json")]):
        assert plan_main(argv + bad) == 2
        err = capsys.readouterr().err
        assert err.startswith("flexh2o-plan: error:") and err.count("\n") == 1


def _load(name: str) -> dict:
    with open(os.path.join(HW_DIR, name)) as f:
        return json.load(f)


def _named(name: str) -> ModelConfig:
    from flexh2o.config import from_name
    return from_name(name)


# slow: measures this machine (a quick profile); the model's reading of a profile: the tests above
@pytest.mark.slow
def test_quick_profile_has_every_figure_the_model_reads(tmp_path, capsys):
    from flexh2o.cli.profile import main as profile_main
    out = tmp_path / "hw.json"
    assert profile_main(["--quick", "--dtype", "float32", "--offload-dir", str(tmp_path / "off"),
                         "--output", str(out)]) == 0
    prof = json.loads(out.read_text())
    table = prof["matmul_flops_by_rows"]["float32"]
    assert sorted(int(k) for k in table) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert all(v > 0 for v in table.values())
    for key in ("disk_read_bw", "disk_write_bw", "disk_read_bw_busy", "op_overhead_s", "parallel_op_s"):
        assert prof[key] > 0, key
    assert 0 < prof["compute_busy"] <= 1
    assert not any((tmp_path / "off").iterdir())  # the run directory is removed
    r = Rates.from_profile(prof, torch.float32)
    assert r.matmul_by_rows and r.disk_read_busy == prof["disk_read_bw_busy"]
    assert predict(toy_rc((0, 0, 100, 0, 100, 0)), prof).decode_s_per_token > 0
    assert "matmul by rows float32" in capsys.readouterr().err
