"""What flexh2o-run asks of the tuning tools before it runs: the hardware profile for --hardware (measured and cached
by tuning/profile_cache.py) and the cost model's prediction on it (advisory: a missing figure only warns)."""
from __future__ import annotations

import sys
from typing import Optional

from flexh2o.dtypes import parse_dtype
from flexh2o.run_config import RunConfig


def hardware_profile(args, rc: RunConfig) -> tuple:
    """(profile or None, label) for --hardware (tuning/profile_cache.py); warnings and hints go to stderr."""
    from flexh2o.tuning.profile_cache import resolve
    need = args.dry_run or args.policy == "auto"
    compute = [rc.compute, rc.decode_compute] if hasattr(args, "dtype_choice") else None  # --policy auto: later
    if compute is None and args.compute_dtype not in (None, "auto"):
        compute = parse_dtype(args.compute_dtype)
    hw, label, warning = resolve(args.hardware, rc.device, compute, args.offload_dir, may_measure=need)
    if warning:
        print(f"flexh2o-run: {warning}", file=sys.stderr)
    return hw, label  # no profile yet on a plain run: no prediction, and nothing said (it is advisory)


def predict_run(rc: RunConfig, hw: Optional[dict], quiet: bool = False) -> Optional[dict]:
    """The cost model's headline figures for rc on profile hw (None without a profile or a figure it needs; a
    missing figure warns unless `quiet`: a plain run, where the prediction is advisory and goes to the record)."""
    if hw is None:
        return None
    from flexh2o.tuning.cost_model import predict
    from flexh2o.tuning.efficiency import step_work
    try:
        return {**predict(rc, hw).as_dict(), "work": step_work(rc, hw)}  # work: the summary's efficiency line
    except (ValueError, KeyError) as e:  # predictions are advisory: a profile without this dtype only warns
        if not quiet:
            print(f"flexh2o-run: warning: no prediction ({' '.join(str(e).split())})", file=sys.stderr)
        return None
