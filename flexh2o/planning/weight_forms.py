"""A run's WeightForms (weights/forms.py), decided once: which phases' decoder-block matmuls run the int4 kernel,
by the one rule of compress/choice.py given a timer (the engine passes its probe, cached per machine by
planning/kernel_probe.py; the cost model a profile's rates, tuning/kernel_cost.py), the kernel also where
expanding would not fit the memory plan; at which phases matmul weights are converted on use, where converting
whole layers would not fit (weights/on_use.py); and the run's one memory plan, as those forms take the weights
(`run_plan`)."""
from __future__ import annotations

from typing import Callable

from flexh2o.compress.choice import PHASES, kernel_phases
from flexh2o.planning.memory_plan import MemoryPlan, plan_for
from flexh2o.weights.forms import WeightForms


def run_plan(rc, timer: Callable, available: bool = True) -> MemoryPlan:
    """The run's one memory plan, with its WeightForms (plan.forms): refused (ValueError) where even the least
    memory the run may take does not fit, before anything is timed; then as the chosen forms take the weights."""
    least = plan_for(rc, rc.placement, WeightForms.least(rc))
    least.check()
    plan = least.with_forms(weight_forms(rc, timer, least.fits, available))
    plan.check()
    return plan


def weight_forms(rc, timer: Callable, fits: Callable[[WeightForms], bool], available: bool = True) -> WeightForms:
    """rc's WeightForms: where the int4 kernel runs (kernel_choice), and the matmul weights converted on use at the
    fewest phases where those forms do not fit (WeightForms.fitting_on_use; weights/on_use.py)."""
    forms = kernel_choice(rc, timer, fits, available)
    return forms if fits(forms) else forms.fitting_on_use(fits)


def kernel_choice(rc, timer: Callable, fits: Callable[[WeightForms], bool], available: bool = True) -> WeightForms:
    """rc's WeightForms with the int4 kernel where it runs. timer(shape, rows, spec, dtypes) -> phase ->
    {"int4": s, "generic": s} for one weight (choice.probe's answer); fits(forms) -> whether the memory plan fits
    those forms; available: this torch runs the kernel on rc.device (the cost model assumes it does)."""
    forms = WeightForms.of_run(rc)
    usable = forms.layout and available
    if rc.weight_kernel == "int4" and not usable:
        raise ValueError(f"--weight-kernel int4: this torch has no int4 kernel for device {rc.device} "
                         "(use --weight-kernel auto)")
    layers = rc.placement.weights.layer_specs
    ordered = [s for layer in layers for s in layer if forms.in_kernel_order(s)] if usable else []
    if not ordered:
        return forms
    blocks = [s for layer in layers[1:-1] for s in layer if s in ordered]  # the blocks' matmuls
    probed = max(blocks or ordered, key=lambda s: s.shape[0] * s.shape[1])
    rows = {"prefill": rc.prefill_rows() * rc.prompt_len, "decode": rc.gpu_batch_size}
    dtypes = {p: forms.compute_at(p) for p in PHASES}
    chosen = kernel_phases(rc.weight_kernel, probed.shape, rows, forms.spec(probed), dtypes,
                           lambda kernel: fits(forms.with_kernel(p for p in PHASES if kernel[p])), timer)
    return forms.with_kernel(p for p in PHASES if chosen[p])
