"""The memory plan, the largest-batch search, --dry-run and the cost model count compressed bytes."""
from __future__ import annotations

import math

import pytest
import torch

from flexh2o.compress import CompressionSpec
from flexh2o.compress.defaults import DEFAULT_CACHE_GROUP, DEFAULT_GROUP
from flexh2o.config import from_name
from flexh2o.kv.policies.base import Budget
from flexh2o.kv.spec import KVSpec
from flexh2o.models import layer_specs
from flexh2o.placement import Percent
from flexh2o.planning.memory_plan import cache_block_bytes, largest_batch, plan_memory
from flexh2o.run_config import RunConfig
from flexh2o.weights.forms import WeightForms

W4, C4 = CompressionSpec(4, 64, 0), CompressionSpec(4, 64, -1)


def _rc(model="opt-1.3b", percent=(0, 100, 100, 0), dtype=torch.float16, **kw) -> RunConfig:
    return RunConfig(model=from_name(model), percent=Percent.parse(list(percent)), gpu_batch_size=8, prompt_len=512,
                     gen_len=32, dtype=dtype, gpu_mem=16 << 30, cpu_mem=200 << 30, **kw)


def _flexgen_bytes(shape: tuple) -> int:
    """4-bit FlexGen layout written out: two values a byte, groups of 64 along dim 0 padded, fp16 scale and min."""
    if len(shape) == 1:
        return 2 * shape[0]
    rest = math.prod(shape[1:])
    groups = -(-shape[0] // 64)
    return groups * 64 * rest // 2 + groups * rest * 2 * 2


@pytest.mark.parametrize("percent, tier", [((100, 0, 100, 0), "gpu"), ((0, 100, 100, 0), "cpu"),
                                           ((0, 0, 100, 0), "disk")])
def test_weight_bytes_per_tier_shrink_to_the_compressed_layout(percent, tier):
    plain, packed = plan_memory(_rc(percent=percent)), plan_memory(_rc(percent=percent, compress_weight=W4))
    unique = {s.name: s for layer in layer_specs(from_name("opt-1.3b")) for s in layer}.values()
    assert packed.bytes[tier]["weights"] == sum(_flexgen_bytes(s.shape) for s in unique)
    assert plain.bytes[tier]["weights"] == sum(2 * s.numel for s in unique)
    ratio = packed.bytes[tier]["weights"] / plain.bytes[tier]["weights"]
    assert 4.5 / 16 <= ratio < 4.5 / 16 * 1.01  # 1-D weights stay fp16


@pytest.mark.parametrize("bits, want", [(4, (64 // 2 + 4) / (2 * 64)), (8, (64 + 4) / (2 * 64))])
def test_cache_bytes_shrink_by_the_expected_factor(bits, want):
    rc = _rc(kv=KVSpec("h2o", Budget(102, 102)))
    spec = CompressionSpec(bits, 64, -1)
    d = rc.model.head_dim  # 64 for opt-1.3b: one group per token and head
    rows = rc.gpu_batch_size * rc.model.kv_heads * rc.cache_slots()
    plain, packed = cache_block_bytes(rc), cache_block_bytes(rc.with_(compress_cache=spec))
    assert plain == rows * (2 * d * 2 + 12) and packed == rows * (2 * d * 2 * want + 12)
    assert plan_memory(rc.with_(compress_cache=spec)).bytes["gpu"]["cache"] == packed * rc.model.num_layers


def test_largest_batch_grows_with_a_compressed_cache():
    rc = _rc("opt-30b", kv=KVSpec("h2o", Budget(102, 102)))
    plain, packed = largest_batch(rc), largest_batch(rc.with_(compress_cache=C4))
    assert packed > 2 * plain > 0


def test_mission_dry_run_reports_the_larger_batch(capsys):
    from flexh2o.cli import run as cli

    def batches(extra):
        assert cli.main(["--model", "opt-30b", "--percent", "0", "100", "100", "0", "--hh-ratio", "0.2",
                         "--gpu-mem", "16GB", "--cpu-mem", "200GB", "--dtype", "float16", "--dry-run"] + extra) == 0
        out = capsys.readouterr().out
        line = [ln for ln in out.splitlines() if ln.startswith("largest --gpu-batch-size")][0]
        return out, {k: int(v) for k, v in (p.split() for p in line.split(": ")[1].split(", "))}
    _, given = batches([])
    out, default = batches(["--compress-weight", "--compress-cache"])
    assert f"compressed weights 4-bit/{DEFAULT_GROUP}, cache 4-bit/{DEFAULT_CACHE_GROUP}" in out
    # the 4-bit cache of groups of 64 with the newest 16 tokens exact, as the assertions below were counted
    _, packed = batches(["--compress-weight", "--compress-cache", "--cache-group-size", "64", "--cache-recent", "16"])
    # the uncompressed run converting whole layers to fp32 (35 and 14); its own plan converts its matmul weights on
    # use where those do not fit (weights/on_use.py: 50 and 20), which fits more
    whole = {p: largest_batch(_rc("opt-30b", kv=kv), plan_of=lambda r: plan_memory(r, forms=WeightForms.planned(r)))
             for p, kv in (("h2o", KVSpec("h2o", Budget(102, 102))), ("full", KVSpec()))}
    assert given["h2o"] > whole["h2o"] and given["full"] > whole["full"], (given, whole)
    # auto keeps room to expand a block at either phase: 35 -> 71, 14 -> 34 (counted at 066f001)
    assert packed["h2o"] > 2 * whole["h2o"] and packed["full"] > 2 * whole["full"], (whole, packed)
    # the default's groups of 32 and newest 32 tokens exact take more bytes a row (35 -> 61, 14 -> 31 at 62c902b)
    assert all(1.5 * whole[p] < default[p] <= packed[p] for p in whole), (whole, default, packed)
    # int4 runs every block matmul by the kernel, no expanded copy (weights/forms.py): 35 -> 111, 14 -> 50 at 066f001
    # (the cache without its exact window (--cache-recent), whose fp16 tokens of K and V a row would take more)
    _, kernel = batches(["--compress-weight", "--compress-cache", "--weight-kernel", "int4", "--cache-recent", "0"])
    assert kernel["h2o"] > 3 * whole["h2o"] and kernel["full"] > 3 * whole["full"], (whole, kernel)


def test_cost_model_reads_compressed_weights_from_disk():
    """Disk-streamed weights: the predicted disk read per decode step shrinks to the compressed bytes, and the
    expansion is charged to compute."""
    from flexh2o.tuning.cost_model import predict
    from flexh2o.tuning.hardware import Rates, load_profile
    from flexh2o.weights.stored_form import disk_table_reads, disk_tables_of_run
    hw = load_profile("cpu_measured")
    rc = _rc(percent=(0, 0, 100, 0), dtype=torch.bfloat16, compute_dtype=torch.bfloat16)
    plain, packed = predict(rc, hw), predict(rc.with_(compress_weight=W4), hw)
    read = {k: p.terms["decode"]["disk.weights_read"] for k, p in (("plain", plain), ("packed", packed))}
    # the plain lookup's tables are read by rows (DiskTables, weights/stored_form.py): with them read whole, as the
    # 4-bit ones are, the read is 4-bit groups' ~0.28 of 16-bit
    r, (table, shapes) = Rates.from_profile(hw, torch.bfloat16), disk_tables_of_run(rc)[0]
    rows, spans = disk_table_reads(0, shapes, rc.dtype, rc.gpu_batch_size, rc.num_gpu_batches)
    whole = read["plain"] + (table - rows) / r.disk_read - (spans - len(shapes)) * r.read_latency
    assert read["plain"] < whole and 0.27 < read["packed"] / whole < 0.30
    assert "compute.expand_weights" in packed.terms["decode"] and "compute.expand_weights" not in plain.terms["decode"]


@pytest.mark.parametrize("flags", [["--compress-weight", "--compress-cache"],
                                   ["--compress-cache", "--compress-bits", "8", "--cache-group-size", "16"],
                                   ["--compress-weight", "--weight-kernel", "off"],
                                   ["--compress-weight", "--weight-kernel", "int4"]])
def test_plan_searches_compressed_and_its_command_line_runs_the_same(flags, capsys):
    """flexh2o-plan takes the compression flags (the ones flexh2o-run shares) and prints a flexh2o-run command line
    that reads back to the same compression."""
    from flexh2o.cli import plan as plan_cli
    from flexh2o.cli import run as run_cli
    from flexh2o.tuning.search import command_line
    argv = ["--model", "opt-125m", "--prompt-len", "32", "--gen-len", "4", "--hardware", "cpu_measured", "--gpu-mem",
            "1GB", "--cpu-mem", "2GB", "--disk-mem", "4GB", "--step", "50", "--max-num-gpu-batches", "1", "--top", "1"]
    rc, _ = plan_cli.plan_from_args(plan_cli.build_parser().parse_args(argv + flags))
    assert plan_cli.main(argv + flags) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1].split()
    line = command_line(rc).split()
    assert set(flags) <= set(printed) and set(flags) <= set(line)
    back = run_cli.build_run_config(run_cli.build_parser().parse_args(line[1:]), rc.model, None)
    assert (back.compress_weight, back.compress_cache, back.weight_kernel) == \
        (rc.compress_weight, rc.compress_cache, rc.weight_kernel)
