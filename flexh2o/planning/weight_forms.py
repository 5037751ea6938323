"""Which phases of a run take the int4 kernel for the decoder blocks' matmuls (compress/choice.py decides from the
largest block weight; a phase is expanded only where the memory plan fits it)."""
from __future__ import annotations

from flexh2o.compress.choice import PHASES, kernel_phases
from flexh2o.compress.codec import weight_spec
from flexh2o.planning.memory_plan import plan_memory
from flexh2o.weights.forms import in_kernel_order


def run_kernel_phases(rc, usable: bool) -> dict:
    """phase -> True where the decoder blocks' matmuls run the int4 kernel; usable: the layout and the device allow
    the kernel at all."""
    layers = rc.placement.weights.layer_specs
    names = [s for layer in layers for s in layer if in_kernel_order(s, rc.compress_weight, usable)]
    if not names:
        return dict.fromkeys(PHASES, False)
    blocks = [s for layer in layers[1:-1] for s in layer if s in names]  # the blocks' matmuls
    probed = max(blocks or names, key=lambda s: s.shape[0] * s.shape[1])
    rows = {"prefill": rc.prefill_rows() * rc.prompt_len, "decode": rc.gpu_batch_size}
    dtypes = {"prefill": rc.compute_at(0), "decode": rc.compute_at(1)}
    spec = weight_spec(probed.shape, rc.compress_weight, probed.name)  # a kept block's own grouping
    return kernel_phases(rc.weight_kernel, probed.shape, rows, spec, dtypes,
                         lambda kernel: plan_memory(rc, kernel=kernel).overflow() is None)
