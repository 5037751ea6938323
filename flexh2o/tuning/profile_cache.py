"""`--hardware auto`: a profile of this machine, cached per fingerprint in machine.cache_dir(), measured (quick, with
a progress bar on stderr) the first time it is needed; and the one-line warning for a profile of another machine.

Named or file profiles (`--hardware t4_paper`, `--hardware FILE`) still load as before, for planning other
hardware; when they predict a run here and their fingerprint differs from this machine's, a warning says so.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional

from flexh2o.dtypes import dtype_name
from flexh2o.planning import machine
from flexh2o.tuning.hardware import load_profile

AUTO = "auto"
PROFILE_VERSION = 2  # 2: products timed as the engine runs them (models.common.linear); the load is the one they saw
FAST_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # CPUs where bfloat16 is worth profiling by default


def profile_file(device: str, fp: Optional[dict] = None) -> str:
    """The cache file name of this machine's profile (or of fingerprint `fp`); a profile measured by other probes
    (an older PROFILE_VERSION) is never read."""
    return f"hardware-v{PROFILE_VERSION}-{_machine_key(device, fp)}.json"


def _machine_key(device: str, fp: Optional[dict] = None) -> str:
    return f"{device.split(':')[0]}-{machine.fingerprint_key(fp or machine.fingerprint(device))}"


def wanted_dtypes(device: str, compute=None) -> list:
    """Compute dtypes an auto profile holds: float32 (and float16 on CUDA, bfloat16 on CPUs with bf16 hardware),
    plus the run's own (`compute`: a dtype name or a list of them, e.g. prefill's and decode's)."""
    fp = machine.fingerprint(device)
    out = ["float16", "float32"] if device.startswith("cuda") else ["float32"]
    if not device.startswith("cuda") and any(f in fp["cpu_flags"] for f in FAST_BF16_FLAGS):
        out.append("bfloat16")
    for c in _names(compute):
        if c not in out:
            out.append(c)
    return out


def _names(compute) -> list:
    return [] if compute is None else [compute] if isinstance(compute, str) else list(compute)


def auto_profile(device: str, compute, offload_dir: Optional[str], may_measure: bool,
                 measure: Optional[Callable] = None, add: Optional[Callable] = None) -> Optional[dict]:
    """This machine's cached profile (measured again, when may_measure, if it was taken on a busy machine that is now
    much quieter: machine.stale_by_load); else, if may_measure, a quick one measured now (wanted_dtypes) and cached;
    else None. `compute`: the run's compute dtype name(s). A cached profile without one of them gets that dtype's
    rates measured now and cached too when may_measure (a few seconds, with a progress bar); otherwise it is returned
    as it is (the prediction then warns and names the flexh2o-profile command that adds it). A dtype added so that
    was measured on a busy machine that is now much quieter is measured again."""
    from flexh2o.tuning import measure as profiler
    name = profile_file(device)
    prof = machine.read_cached(name)
    if prof and may_measure and machine.stale_by_load(prof.get("load_at_measure")):
        print(f"note: the cached profile of this machine was measured at load {prof['load_at_measure']:.1f} "
              f"(now {machine.load_now():.1f}): measuring it again", file=sys.stderr)
        prof = None
    if prof:
        busy = prof.get("dtype_load_at_measure", {})
        stale = [c for c in _names(compute) if may_measure and machine.stale_by_load(busy.get(c))]
        if stale:
            print(f"note: the cached {', '.join(stale)} rates of this machine were measured at load "
                  f"{max(busy[c] for c in stale):.1f} (now {machine.load_now():.1f}): measuring them again",
                  file=sys.stderr)
        missing = [c for c in _names(compute) if c not in prof.get("matmul_flops", {}) or c in stale]
        if not (missing and may_measure):
            return prof
        with _bar(2 * len(missing), f"profiling {', '.join(missing)} on this machine (once, cached)") as bar:
            prof = (add or profiler.add_dtypes)(prof, missing, progress=bar.update)
    else:
        if not may_measure:
            return None
        dtypes = wanted_dtypes(device, compute)
        with _bar(profiler.measure_steps(dtypes, offload_dir), "profiling this machine (once, cached)") as bar:
            prof = (measure or profiler.measure)(device, dtypes, offload_dir, True, progress=bar.update)
        prof["name"] = f"auto-{_machine_key(device)}"
    prof.pop("cached_at", None)
    prof["cached_at"] = machine.write_cached(name, prof)
    return prof


def _bar(total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, file=sys.stderr, unit="step")


def mismatch_warning(hw: dict, device: str, label: str) -> Optional[str]:
    """One line when `hw` was not measured on this machine (or carries no fingerprint), else None."""
    diff = machine.differences(hw.get("fingerprint"), machine.fingerprint(device))
    if not diff:
        return None
    what = "has no machine fingerprint" if diff == ["fingerprint"] else f"was measured on another machine " \
        f"({', '.join(diff)} differ)"
    return f"warning: hardware profile {label} {what}: predictions may not hold here (--hardware auto profiles " \
        "this machine)"


def resolve(arg: Optional[str], device: str, compute, offload_dir: Optional[str], may_measure: bool) -> tuple:
    """(profile or None, label, warning or None) for --hardware `arg` (auto, a shipped name or a file); `compute`:
    the run's compute dtype(s), a torch dtype or a list (prefill's and decode's), or None."""
    if arg in (None, AUTO):
        given = [] if compute is None else list(compute) if isinstance(compute, (list, tuple)) else [compute]
        names = [dtype_name(c) for c in given]
        hw = auto_profile(device, list(dict.fromkeys(names)), offload_dir, may_measure)
        return hw, "of this machine (auto)", None
    hw = load_profile(arg)
    return hw, arg, mismatch_warning(hw, device, arg)
