"""The memory plan counts the transient of storing the largest 4-bit weight (compress/tier.py: the weight gathered
whole in the storage dtype, the codec's fp32 slabs, the compressed parts and their join), from the weights' shapes:
a batch-1 plan of opt-1.3b with 4-bit weights peaked at its load, 632 MiB of anonymous memory against 442 MiB in its
prefill and decode, while its plan counted 227 MiB (benchmarks/plan_memory.py, RESULTS row 127)."""
from __future__ import annotations

import pytest
import torch

from flexh2o.compress import CompressionSpec
from flexh2o.compress.codec import quantize, weight_spec
from flexh2o.compress.tier import SLAB_BYTES
from flexh2o.config import from_name
from flexh2o.placement import Percent
from flexh2o.compress.choice import PHASES
from flexh2o.planning.memory_plan import in_flight_bytes, largest_batch, plan_memory, store_transient_bytes
from flexh2o.run_config import RunConfig


def _rc(compress: bool, **kw) -> RunConfig:
    kw = {"gpu_mem": 4 << 30, "cpu_mem": 400 << 20, **kw}
    return RunConfig(model=from_name("opt-125m"), percent=Percent.parse(["0", "10", "0", "0", "100", "0"]),
                     gpu_batch_size=1, prompt_len=128, gen_len=2, dtype=torch.bfloat16,
                     compute_dtype=torch.float32, compress_weight=CompressionSpec() if compress else None, **kw)


def _measured_compressed_bytes(shape: tuple, spec: CompressionSpec) -> int:
    """Bytes of the codec's own output for a weight of `shape` (data and meta as quantize returns them)."""
    ct = quantize(torch.randn(shape), spec, torch.bfloat16)
    return ct.data.numel() * ct.data.element_size() + ct.meta.numel() * ct.meta.element_size()


def test_the_largest_weights_store_transient_is_counted_from_its_shape():
    rc = _rc(True)
    table = max(rc.placement.weights.unique_specs(), key=lambda s: s.numel)  # opt-125m's (50272, 768) embedding
    assert table.shape == (50272, 768)
    spec = weight_spec(table.shape, rc.compress_weight, table.name)
    gathered = table.numel * 2  # the whole weight in bf16
    slabs = 3 * min(SLAB_BYTES, 4 * table.numel)  # the fp32 input slab, x - minimum, its quotient
    expected = gathered + 3 * _measured_compressed_bytes(table.shape, spec) + slabs
    assert store_transient_bytes(rc, rc.placement) == expected


def test_a_plan_holds_the_store_transient_in_its_compute_buffers_and_refuses_below_it():
    rc = _rc(True)
    need = store_transient_bytes(rc, rc.placement)
    plan = plan_memory(rc)
    assert plan.bytes["gpu"]["buffers"] >= need
    assert store_transient_bytes(_rc(False), _rc(False).placement) == 0  # nothing is quantized at the load
    small = _rc(True, gpu_mem=need - 1)  # the transient alone is over the compute tier: no batch fits
    assert plan_memory(small).overflow()[0] == "gpu"
    assert largest_batch(small) == 0


@pytest.mark.parametrize("batch", [1, 64])
def test_the_buffers_are_the_larger_of_the_store_transient_and_the_run_s_own(batch):
    """At the load no compute buffer exists yet: the two are not added, the larger one is counted."""
    rc = _rc(True).with_(gpu_batch_size=batch)
    plan = plan_memory(rc)
    run_s_own = plan.working + max(in_flight_bytes(rc, plan.where, plan.forms, p) for p in PHASES)
    need = store_transient_bytes(rc, rc.placement)
    assert plan.bytes["gpu"]["buffers"] == max(need, run_s_own) + plan.kept_scales
