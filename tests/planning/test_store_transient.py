"""The memory plan counts the transient of storing the largest 4-bit weight (compress/tier.py: a (N, K) weight
quantized and written a slab of rows at a time, the slab's input, the codec's fp32 slabs, the slab's compressed
bytes, the meta of every slab), from the weights' shapes: a batch-1 plan of opt-1.3b with 4-bit weights, when the
weight was gathered whole and its parts joined, peaked at its load, 632 MiB of anonymous memory against 442 MiB in
its prefill and decode, while its plan counted 227 MiB (benchmarks/plan_memory.py, RESULTS row 127)."""
from __future__ import annotations

import pytest
import torch

from flexh2o.compress import CompressionSpec
from flexh2o.compress.codec import quantize, weight_spec
from flexh2o.compress.tier import SLAB_BYTES, slab_rows
from flexh2o.config import from_name
from flexh2o.placement import Percent
from flexh2o.planning.memory_plan import largest_batch, plan_memory, store_transient_bytes
from flexh2o.run_config import RunConfig
from flexh2o.tuning.least import least_message

ROW_122_GPU = 845245372  # the compute tier of RESULTS row 122 (opt-1.3b under a 1.25 GiB cap)


def _rc(compress: bool, model: str = "opt-125m", **kw) -> RunConfig:
    """4-bit weights as flexh2o-run stores them: groups of 64 along dim 1."""
    kw = {"gpu_mem": 4 << 30, "cpu_mem": 400 << 20, **kw}
    return RunConfig(model=from_name(model), percent=Percent.parse(["0", "10", "0", "0", "100", "0"]),
                     gpu_batch_size=1, prompt_len=128, gen_len=2, dtype=torch.bfloat16,
                     compute_dtype=torch.float32, compress_weight=CompressionSpec(4, 64, 1) if compress else None, **kw)


def _measured_compressed_bytes(shape: tuple, spec: CompressionSpec) -> int:
    """Bytes of the codec's own output for a weight of `shape` (data and meta as quantize returns them)."""
    ct = quantize(torch.randn(shape), spec, torch.bfloat16)
    return ct.data.numel() * ct.data.element_size() + ct.meta.numel() * ct.meta.element_size()


def test_the_largest_weights_store_transient_is_counted_from_its_shape():
    rc = _rc(True)
    table = max(rc.placement.weights.unique_specs(), key=lambda s: s.numel)  # opt-125m's (50272, 768) embedding
    assert table.shape == (50272, 768)
    spec = weight_spec(table.shape, rc.compress_weight, table.name)
    rows = slab_rows(table.shape, spec)
    assert rows == SLAB_BYTES // (4 * 768) < 50272  # a slab is SLAB_BYTES of fp32 input, in several slabs
    slab = (rows, 768)
    gathered = rows * 768 * 2  # the slab regathered from the seeded pieces in bf16
    slabs = 3 * 4 * rows * 768  # the fp32 input slab, x - minimum, its quotient
    whole = quantize(torch.randn(table.shape), spec, torch.bfloat16)
    metas = 2 * whole.meta.numel() * whole.meta.element_size()  # every slab's meta, and their join
    expected = gathered + slabs + 3 * _measured_compressed_bytes(slab, spec) + metas
    assert store_transient_bytes(rc, rc.placement) == expected


def test_a_plan_holds_the_store_transient_beside_its_weights_and_refuses_below_it():
    rc = _rc(True, "opt-125m", gpu_mem=ROW_122_GPU)
    need = store_transient_bytes(rc, rc.placement)
    plan = plan_memory(rc)  # batch 1, its weights converted on use: the load is the compute tier's peak
    gpu = plan.bytes["gpu"]
    assert plan.total("gpu") == gpu["weights"] + gpu["cache"] + need > sum(gpu.values())
    assert plan.load_tier() == "gpu" and "at the load" in plan.describe()
    assert store_transient_bytes(_rc(False), _rc(False).placement) == 0  # nothing is quantized at the load
    small = _rc(True, "opt-125m", gpu_mem=need - 1)  # the transient alone is over the compute tier: no batch fits
    assert plan_memory(small).overflow()[0] == "gpu"
    assert largest_batch(small) == 0
    with pytest.raises(ValueError, match="at the load but --gpu-mem allows"):
        plan_memory(small).check()
    assert "at the load: storing the largest 4-bit weight" in least_message(small)  # no placement spares it


@pytest.mark.parametrize("batch", [1, 64, 512])
def test_a_tier_s_total_is_the_larger_of_the_load_and_the_run(batch):
    """At the load no activation or compute buffer exists yet: the two are not added, the larger one is counted."""
    rc = _rc(True, "opt-1.3b", gpu_mem=ROW_122_GPU).with_(gpu_batch_size=batch)
    plan = plan_memory(rc)
    gpu = plan.bytes["gpu"]
    run = gpu["weights"] + gpu["cache"] + gpu["activations"] + gpu["buffers"]
    assert plan.total("gpu") == max(run, gpu["weights"] + gpu["cache"] + store_transient_bytes(rc, rc.placement))
    assert plan.total("cpu") == sum(plan.bytes["cpu"].values())  # the transient is the compute side's, not both
