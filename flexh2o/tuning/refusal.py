"""The pre-flight refusal: when the plan does not fit, one line that says what overflows AND names a placement and
batch that do fit on this machine (the best the policy search finds for the same model, lengths, KV policy, dtypes
and capacities), with its predicted time when this machine has a profile."""
from __future__ import annotations

import sys
from typing import Optional

from flexh2o.planning.memory_plan import plan_memory


def check_fits(rc, hw: Optional[dict], progress: bool = False) -> None:
    """Nothing when rc's plan fits; else ValueError: the plan's own message plus the searched alternative.
    progress: a bar on stderr while the search runs (a minute or more for a large model)."""
    plan = plan_memory(rc)
    if plan.overflow() is None:
        return
    try:
        plan.check()
    except ValueError as e:
        raise ValueError(f"{e}. {suggestion(rc, hw, progress)}") from None


def suggestion(rc, hw: Optional[dict], progress: bool = False) -> str:
    """'This fits here: --percent ... --gpu-batch-size B --num-gpu-batches N (predicted prefill P s, decode D s,
    X tok/s ...)' with hw, this machine's profile; without one the placement is ranked on a shipped profile and no
    time is given. Or what to raise when nothing fits."""
    from flexh2o.tuning.search import search
    ranking = hw
    if hw is None:
        from flexh2o.tuning.hardware import load_profile
        ranking = load_profile("cpu_measured" if rc.device == "cpu" else "t4_paper")  # ranking only
    bar = _SearchBar() if progress else None
    try:
        found = search(rc, ranking, step=REFUSAL_STEP, max_num_gpu_batches=REFUSAL_GPU_BATCHES, limit=1,
                       refine=REFUSAL_REFINE, progress=bar)
    except ValueError:  # the profile has no rates for this compute dtype
        found = []
    finally:
        if bar is not None:
            bar.close()
    if not found:
        from flexh2o.tuning.least import least_message
        least = least_message(rc)
        return (least[0].upper() + least[1:]) if least else (
            "Nothing fits even one sequence at any --percent: raise --gpu-mem/--cpu-mem/--disk-mem")
    best, pred = found[0]
    return (f"This fits here: --percent {best.percent} --gpu-batch-size {best.gpu_batch_size} --num-gpu-batches "
            f"{best.num_gpu_batches}" + (" --cpu-cache-compute" if best.cpu_cache_compute else "")
            + f" ({predicted_time(pred) if hw is not None else NO_PROFILE}; policy search, --policy auto picks it)")


# a refusal answers within two seconds, torch's import (1.4 s) included: its search names a placement that fits, and
# --policy auto searches for the best one. Placements in steps of 50% (weights all on gpu, cpu or disk, or halves;
# the least-memory one among them), up to 8 GPU batches, the 4 best refined: on opt-125m's refused batch of 100000
# (AMD EPYC Zen 4, 2 vCPU, 2026-12-06) 0.24 s instead of 1.18 s for steps of 25, up to 32 GPU batches and 16
# refined, for a placement predicted 0.2% slower (68.31 against 68.41 tok/s on the cpu_measured profile)
REFUSAL_STEP = 50
REFUSAL_GPU_BATCHES = 8
REFUSAL_REFINE = 4

NO_PROFILE = ("no predicted time: no profile of this machine yet (flexh2o-run --dry-run measures one once, under a "
              "minute)")


def predicted_time(pred) -> str:
    """The cost model's figures of a suggested placement, in words."""
    return (f"predicted by the cost model: prefill {seconds(pred.prefill_s)}, decode {seconds(pred.decode_s)}, "
            f"{pred.total_throughput:.3g} tok/s")


def seconds(s: float) -> str:
    """'0.52 s', '95 s', '19,363 s (5.4 h)'."""
    if s < 100:
        return f"{s:.3g} s"
    return f"{s:,.0f} s" + (f" ({s / 3600:.1f} h)" if s >= 3600 else "")


class _SearchBar:
    """tqdm bar over the search's weight splits, created on the first call (when the total is known)."""

    def __init__(self):
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc="searching for a placement that fits", unit="split", file=sys.stderr,
                            leave=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
