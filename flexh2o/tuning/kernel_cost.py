"""Where the cost model assumes the int4 kernel runs: the engine's rule (planning/weight_forms.py) timed by the
profile's rates instead of the engine's probe."""
from __future__ import annotations

from typing import Callable

from flexh2o.planning.memory_plan import plan_memory
from flexh2o.planning.weight_forms import weight_forms
from flexh2o.run_config import RunConfig
from flexh2o.weights.forms import WeightForms

EXPAND_PASSES = 1.8  # expanding a compressed tensor costs this many dtype conversions of it (measured: see RESULTS)


def kernel_forms(rc: RunConfig, rates: dict) -> WeightForms:
    """rc's WeightForms as the engine decides them, from the profile's rates (phase -> Rates): the faster of expand
    + matmul and the kernel for one weight at the phase's rows, the kernel also where expanding would not fit."""
    return weight_forms(rc, rates_timer(rc, rates), lambda forms: plan_memory(rc, forms=forms).overflow() is None)


def rates_timer(rc: RunConfig, rates: dict) -> Callable:
    """A timer for the rule (choice.probe's answer) from rates: seconds per weight element of a matmul at a phase's
    rows through the kernel (infinite where the profile has no kernel figures) and expanded + dense."""
    mem = "gpu_mem" if rc.device != "cpu" else "cpu_mem"
    conv = "gpu_mem" if rc.device != "cpu" else "convert"

    def timer(shape: tuple, rows: dict, spec, dtypes: dict) -> dict:
        out = {}
        for phase, r in rates.items():
            m, int4 = rows[phase], r.int4_rate(rows[phase])
            dense = max(2 * m / r.matmul_rate(m, phase == "prefill"), dtypes[phase].itemsize / getattr(r, mem))
            expand = rc.dtype.itemsize * EXPAND_PASSES / getattr(r, conv)
            out[phase] = {"int4": float("inf") if int4 is None else 2 * m / int4, "generic": expand + dense}
        return out
    return timer
