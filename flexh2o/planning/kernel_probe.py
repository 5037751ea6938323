"""This machine's timings of the int4 kernel against the expanded weights (compress/choice.probe), cached per machine
in machine.cache_dir() as the dtype probe is (planning/dtype_choice.py), one entry per probed case: the weight's
shape, the rows each phase multiplies, the compression spec and the phases' compute dtypes.

Measured at every run's start, two paths within the probe's round-to-round spread took either side from one run to
the next, so one plan held two expanded layers in one run and none in the next (its memory 455 MiB apart:
benchmarks/RESULTS.md row 146, 2026-12-07, bd49476). Cached,
every run of a plan on a machine takes the path the first one measured (again after a busy measurement once the
machine is quiet: machine.stale_by_load).
"""
from __future__ import annotations

import json
from typing import Callable, Optional

import torch

from flexh2o.compress import choice
from flexh2o.dtypes import dtype_name
from flexh2o.planning import machine

PROBE_VERSION = 1


def cached_timer(shape: tuple, rows: dict, spec, dtypes: dict, measure: Optional[Callable] = None) -> dict:
    """choice.probe's answer (phase -> {"int4": s, "generic": s}) for this case on this machine: from the cache,
    else measured (by `measure`, default choice.probe) and added to it."""
    measure = measure or choice.probe
    fp = machine.fingerprint("cpu")
    name = f"kernel_probe-v{PROBE_VERSION}-{machine.fingerprint_key(fp)}.json"
    key = case_key(shape, rows, spec, dtypes)
    hit = _cases(name).get(key)
    if isinstance(hit, dict) and isinstance(hit.get("timings"), dict) and not machine.stale_by_load(hit.get("load")):
        return hit["timings"]
    with machine.LoadSeen(torch.get_num_threads()) as seen:
        timings = measure(shape, rows, spec, dtypes)
    cases = _cases(name)  # read again: another process may have added cases meanwhile
    cases[key] = {"timings": timings, "load": seen.load}
    machine.write_cached(name, {"version": PROBE_VERSION, "fingerprint": fp, "cases": cases})
    return timings


def _cases(name: str) -> dict:
    """The cached cases of the file `name` ({} where it is absent, unreadable or of another version)."""
    got = machine.read_cached(name) or {}
    cases = got.get("cases")
    return cases if got.get("version") == PROBE_VERSION and isinstance(cases, dict) else {}


def case_key(shape: tuple, rows: dict, spec, dtypes: dict) -> str:
    """One probed case as a string (the cache's key)."""
    return json.dumps({"shape": [int(n) for n in shape], "rows": {p: int(r) for p, r in sorted(rows.items())},
                       "spec": repr(spec), "dtypes": {p: dtype_name(d) for p, d in sorted(dtypes.items())}},
                      sort_keys=True)
