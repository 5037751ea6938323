"""The cost model charges what runs under --compress-weight: where the int4 kernel runs a phase (by the profile's
kernel rates, as the engine's probe decides), its matmuls at the kernel's rate and no expansion of their weights;
elsewhere expand + dense matmul. Rates are set here, not measured."""
from __future__ import annotations

import pytest
import torch

from flexh2o.compress import CompressionSpec
from flexh2o.compress.kernels import KERNEL_ROWS
from flexh2o.config import from_name
from flexh2o.models import layer_specs
from flexh2o.placement import Percent
from flexh2o.tuning.cost_model import predict
from flexh2o.tuning.kernel_cost import kernel_forms
from flexh2o.weights.forms import WeightForms
from flexh2o.tuning.hardware import Rates, load_profile
from flexh2o.planning.memory_plan import largest_batch, plan_memory
from flexh2o.run_config import RunConfig

W1, C4 = CompressionSpec(4, 64, 1), CompressionSpec(4, 64, -1)
MODEL = from_name("opt-350m")


def _hw(fast_rows: int = 64) -> dict:
    """The shipped CPU profile plus int4 kernel rates: 10x the fp32 rate up to `fast_rows` rows, 0.1x above (slower
    than expand + matmul by more than choice.KERNEL_MARGIN at every phase: at 0.2x, a memory-bound decode step of 16
    rows took 1.10x the generic path's time, within the margin, where the kernel is kept)."""
    hw = dict(load_profile("cpu_measured"))
    dense = Rates.from_profile(hw, torch.float32)
    hw["int4_matmul_flops_by_rows"] = {str(r): dense.matmul_rate(r, r > 1) * (10 if r <= fast_rows else 0.1)
                                       for r in (1, 4, 16, 64, 256, 512)}
    return hw


def kernel_choice(rc: RunConfig, rates: dict) -> dict:
    """phase -> the decoder blocks' matmuls run the int4 kernel, as the cost model decides it from `rates`."""
    return kernel_forms(rc, rates).kernel_by_phase()


def _rc(weight_kernel="auto", **kw) -> RunConfig:
    base = dict(model=MODEL, percent=Percent.parse([0, 0, 100, 0]), gpu_batch_size=16, prompt_len=128, gen_len=16,
                dtype=torch.float16, gpu_mem=2 << 30, cpu_mem=8 << 30, compress_weight=W1, compress_cache=C4,
                weight_kernel=weight_kernel)
    return RunConfig(**{**base, **kw})


def _kernel_params() -> int:
    """Elements of the weights the kernel multiplies in a decode step: 2-D, a multiple of 32 rows, not a lookup."""
    return sum(s.numel for i, layer in enumerate(layer_specs(MODEL)) for s in layer
               if len(s.shape) == 2 and s.shape[0] % KERNEL_ROWS == 0 and not (i == 0 and "embed" in s.name))


def test_decode_runs_the_kernel_at_its_rate_and_expands_only_the_rest():
    hw, rc = _hw(), _rc()
    assert kernel_choice(rc, dict.fromkeys(("prefill", "decode"), Rates.from_profile(hw, torch.float32))) == \
        {"prefill": False, "decode": True}  # 16 decode rows: the kernel; 128 x prefill rows: expand + matmul
    kernel, generic = predict(rc, hw), predict(_rc("generic"), hw)
    dec = kernel.terms["decode"]
    want = 2 * rc.gpu_batch_size * _kernel_params() / Rates.from_profile(hw, torch.float32).int4_rate(16)
    assert dec["compute.int4_matmul"] == pytest.approx(want, rel=1e-9)
    assert "compute.int4_matmul" not in generic.terms["decode"]
    head = sum(s.numel for s in layer_specs(MODEL)[-1] if len(s.shape) == 2)  # one token a sequence: as decode
    assert kernel.terms["prefill"]["compute.int4_matmul"] == pytest.approx(want * head / _kernel_params(), rel=1e-9)
    # what is still expanded at decode: the 2050-row position table (not a multiple of 32) and the token rows read
    assert dec["compute.expand_weights"] < 0.05 * generic.terms["decode"]["compute.expand_weights"]
    assert kernel.terms["prefill"]["compute.expand_weights"] == pytest.approx(
        generic.terms["prefill"]["compute.expand_weights"], rel=0.2)  # prefill expands as the generic path does
    assert kernel.decode_s_per_token < generic.decode_s_per_token
    assert kernel.terms["decode"]["disk.weights_read"] == generic.terms["decode"]["disk.weights_read"]


def test_without_kernel_figures_auto_is_predicted_as_the_generic_path():
    hw = load_profile("cpu_measured")
    assert predict(_rc(), hw).terms == predict(_rc("generic"), hw).terms
    forced = predict(_rc("int4"), hw).terms["decode"]  # --weight-kernel int4 without figures: the dense rate
    assert forced["compute.int4_matmul"] > 0


def test_int4_runs_every_phase_and_slow_kernel_rates_keep_auto_expanding():
    hw = _hw(fast_rows=0)  # the kernel slower at every row count
    rates = dict.fromkeys(("prefill", "decode"), Rates.from_profile(hw, torch.float32))
    assert kernel_choice(_rc(), rates) == {"prefill": False, "decode": False}
    assert kernel_choice(_rc("int4"), rates) == {"prefill": True, "decode": True}
    assert "compute.int4_matmul" in predict(_rc("int4"), hw).terms["prefill"]


def test_the_kernel_is_charged_where_memory_forces_it():
    """At the largest batch the kernel allows under a small --gpu-mem, expanding the blocks at prefill does not fit:
    the engine runs the kernel there (compress/choice.py), so the prediction does too, and its plan is that
    choice's."""
    hw = _hw()
    rc = _rc(gpu_mem=400 << 20, prompt_len=32)
    rc = rc.with_(gpu_batch_size=largest_batch(rc.with_(weight_kernel="int4")))  # the kernel's largest batch
    assert plan_memory(rc, forms=WeightForms.of_run(rc, ["decode"])).overflow()
    rates = dict.fromkeys(("prefill", "decode"), Rates.from_profile(hw, torch.float32))
    assert kernel_choice(rc, rates) == {"prefill": True, "decode": True}
    pred = predict(rc, hw)
    assert pred.terms["prefill"]["compute.int4_matmul"] > 0
    assert pred.bytes == plan_memory(rc, forms=WeightForms.of_run(rc, ["prefill", "decode"])).bytes
