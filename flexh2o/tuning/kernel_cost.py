"""Where the cost model assumes the int4 kernel runs: the engine's rule (compress/choice.py) on the profile's rates."""
from __future__ import annotations

from flexh2o.compress.choice import PHASES, forced_by_memory
from flexh2o.planning.memory_plan import plan_memory
from flexh2o.run_config import RunConfig
from flexh2o.weights.forms import kernel_layout

EXPAND_PASSES = 1.8  # expanding a compressed tensor costs this many dtype conversions of it (measured: see RESULTS)


def kernel_choice(rc: RunConfig, rates: dict) -> dict:
    """phase -> the decoder blocks' matmuls run the int4 kernel, as the engine decides it (compress/choice.py) but
    from the profile's rates (phase -> Rates) instead of its probe: the faster of expand + matmul and the kernel for
    one weight at the phase's rows, the kernel also where expanding would not fit the memory plan."""
    if not kernel_layout(rc) or rc.weight_kernel != "auto":
        return dict.fromkeys(PHASES, kernel_layout(rc) and rc.weight_kernel == "int4")
    faster = {}
    for phase, r in rates.items():
        rows = rc.prefill_rows() * rc.prompt_len if phase == "prefill" else rc.gpu_batch_size
        int4 = r.int4_rate(rows)
        c = rc.compute_at(0 if phase == "prefill" else 1).itemsize
        dense = max(2 * rows / r.matmul_rate(rows, phase == "prefill"), c / (r.gpu_mem if rc.device != "cpu"
                                                                             else r.cpu_mem))
        expand = rc.dtype.itemsize * EXPAND_PASSES / (r.gpu_mem if rc.device != "cpu" else r.convert)
        faster[phase] = int4 is not None and 2 * rows / int4 < expand + dense  # seconds per weight element
    return forced_by_memory(faster, lambda kernel: plan_memory(rc, kernel=kernel).overflow() is None)
