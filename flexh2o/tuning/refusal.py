"""The pre-flight refusal: when the plan does not fit, one line that says what overflows AND names a placement and
batch that do fit on this machine (the best the policy search finds for the same model, lengths, KV policy, dtypes
and capacities)."""
from __future__ import annotations

from typing import Optional

from flexh2o.planning.memory_plan import plan_memory


def check_fits(rc, hw: Optional[dict]) -> None:
    """Nothing when rc's plan fits; else ValueError: the plan's own message plus the searched alternative."""
    plan = plan_memory(rc)
    if plan.overflow() is None:
        return
    try:
        plan.check()
    except ValueError as e:
        raise ValueError(f"{e}. {suggestion(rc, hw)}") from None


def suggestion(rc, hw: Optional[dict]) -> str:
    """'fits here: --percent ... --gpu-batch-size B --num-gpu-batches N (predicted X tok/s)', or what to raise."""
    from flexh2o.tuning.search import search
    if hw is None:
        from flexh2o.tuning.hardware import load_profile
        hw = load_profile("cpu_measured" if rc.device == "cpu" else "t4_paper")  # ranking only
    try:
        found = search(rc, hw, limit=1)
    except ValueError:  # the profile has no rates for this compute dtype
        found = []
    if not found:
        from flexh2o.tuning.least import least_message
        least = least_message(rc)
        return (least[0].upper() + least[1:]) if least else (
            "Nothing fits even one sequence at any --percent: raise --gpu-mem/--cpu-mem/--disk-mem")
    best, pred = found[0]
    return (f"This fits here: --percent {best.percent} --gpu-batch-size {best.gpu_batch_size} --num-gpu-batches "
            f"{best.num_gpu_batches}" + (" --cpu-cache-compute" if best.cpu_cache_compute else "")
            + f" (policy search, predicted {pred.total_throughput:.3g} tok/s; --policy auto picks it)")
