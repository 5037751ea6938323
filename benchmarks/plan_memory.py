"""What a run holds against what its plan counts: flexh2o-run in a memory cgroup of its own (memcap.py), its anonymous
memory, resident set and the group's charge sampled every few milliseconds, beside the plan's bytes (the record's
plan_bytes) and the tiers' accounted peaks.

    python benchmarks/plan_memory.py --cap 6GB -- --model opt-125m --percent 0 0 100 0 100 0 --gpu-batch-size 8 ...

One JSON line: the plan's gpu + cpu bytes, the peaks, and each peak less the plan ("outside": what the plan does not
count, the process's own baseline included). Several configurations: --batches 1,16,64 runs the argv at each
--gpu-batch-size (the baseline is what stays; what grows with the batch is a term the plan misses).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memcap import MemCap  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def _status_kb(pid: int, keys: tuple) -> dict:
    """{key: bytes} of /proc/PID/status lines (VmRSS, RssAnon, RssFile); {} once the process is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k = line.split(":", 1)[0]
                if k in keys:
                    out[k] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def _group_bytes(cap: MemCap) -> dict:
    """The cgroup's charge now and its anonymous part (v1: memory.stat rss; v2: anon)."""
    usage = cap._read_int("memory.current" if cap.v2 else "memory.usage_in_bytes") or 0
    stat = cap._read_keyed("memory.stat")
    return {"usage": usage, "anon": stat.get("anon" if cap.v2 else "rss", 0)}


def sample(pid: int, cap: MemCap, stop: threading.Event, peaks: dict, every: float = 0.01) -> None:
    """Keep in `peaks` the largest of each figure, and the seconds since start at which each was reached."""
    t0 = time.monotonic()
    while not stop.is_set():
        now = {**_status_kb(pid, ("VmRSS", "RssAnon", "RssFile")), **_group_bytes(cap)}
        peaks.setdefault("timeline", []).append((round(time.monotonic() - t0, 2), now.get("anon", 0) // MiB))
        for k, v in now.items():
            if v > peaks.get(k, 0) and k != "timeline":
                peaks[k], peaks[k + "_at_s"] = v, round(time.monotonic() - t0, 2)
        stop.wait(every)


def measure(argv: list, cap_bytes: int, env: dict, timeout: Optional[float] = None) -> dict:
    """One flexh2o-run in its own capped cgroup; the peaks sampled, the cgroup's own peak and the record's plan."""
    fd, log = tempfile.mkstemp(prefix="plan-mem-", suffix=".jsonl")
    os.close(fd)
    cap = MemCap(cap_bytes, os.path.basename(log))
    peaks: dict = {}
    stop = threading.Event()
    try:
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, "-m", "flexh2o.cli"] + argv + ["--log-file", log], env=env, cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=cap.preexec)
        th = threading.Thread(target=sample, args=(p.pid, cap, stop, peaks), daemon=True)
        th.start()
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # the peaks so far are still the figures asked for
            p.kill()
            out, err = p.communicate()
            err += f"\nstopped after {timeout:.0f} s (--timeout)"
        stop.set()
        th.join()
        wall = time.monotonic() - t0
        lines = [ln for ln in open(log) if ln.strip()]
        stats = cap.stats()
    finally:
        stop.set()
        os.unlink(log)
        cap.close()
    rec = json.loads(lines[-1]) if p.returncode == 0 and lines else {}
    timeline = peaks.pop("timeline", [])
    if os.environ.get("PLAN_MEMORY_TIMELINE"):
        with open(os.environ["PLAN_MEMORY_TIMELINE"], "a") as f:
            f.write(json.dumps({"argv": " ".join(argv), "anon_mib": timeline[::10]}) + "\n")
    return summary(argv, rec, peaks, stats, wall, p.returncode, err)


def summary(argv: list, rec: dict, peaks: dict, stats: dict, wall: float, rc: int, err: str) -> dict:
    plan = rec.get("plan_bytes") or {}
    planned = sum(sum((plan.get(t) or {}).values()) for t in ("gpu", "cpu"))
    out = {"argv": " ".join(argv), "exit": rc, "wall_s": round(wall, 1), "load": [round(x, 2) for x in os.getloadavg()],
           "seqs": rec.get("num_seqs"), "planned_mib": round(planned / MiB, 1),
           "plan": {t: {k: round(v / MiB, 1) for k, v in (plan.get(t) or {}).items()} for t in ("gpu", "cpu")},
           "tier_peaks_mib": {k: round((v or 0) / MiB, 1) for k, v in (rec.get("peak_bytes") or {}).items()},
           "cgroup_peak_mib": round((stats.get("peak_charged") or 0) / MiB, 1),
           "sampled_mib": {k: (round(v / MiB, 1) if not k.endswith("_at_s") else v) for k, v in peaks.items()},
           "prefill_s": rec.get("prefill_s"), "decode_s": rec.get("decode_s"),
           "total_tok_s": rec.get("total_throughput"),
           "predicted_tok_s": (rec.get("predicted") or {}).get("total_throughput"),
           "decode_s_per_step": _per_step(rec.get("decode_s"), rec.get("gen_len")),
           "predicted_decode_s_per_step": (rec.get("predicted") or {}).get("decode_s_per_token"),
           "decode_busy_s": rec.get("decode_busy_s")}
    out["outside_mib"] = {k: round(out["sampled_mib"].get(k, 0) - out["planned_mib"], 1) for k in ("RssAnon", "anon")}
    out["outside_mib"]["cgroup_peak"] = round(out["cgroup_peak_mib"] - out["planned_mib"], 1)
    if rc == -9 and stats.get("oom_kills"):
        out["killed_at_the_cap"] = stats
    if rc != 0:
        out["stderr_tail"] = err.strip().splitlines()[-3:]
    return out


def _per_step(decode_s: Optional[float], gen_len: Optional[int]) -> Optional[float]:
    """Seconds a decode step (the tokens after the first)."""
    return None if decode_s is None or not gen_len or gen_len < 2 else round(decode_s / (gen_len - 1), 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cap", default="6GB", help="the cgroup's limit (large: measured, not killed)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds after which the run is stopped (its "
                    "peaks so far are reported)")
    ap.add_argument("--batches", default="", help="comma-separated --gpu-batch-size values to run the argv at")
    ap.add_argument("argv", nargs=argparse.REMAINDER, help="-- then flexh2o-run's flags")
    args = ap.parse_args()
    argv = [a for a in args.argv if a != "--"]
    from flexh2o.units import parse_bytes
    batches = [b for b in args.batches.split(",") if b] or [None]
    for b in batches:
        run = argv if b is None else argv + ["--gpu-batch-size", b]
        print(json.dumps(measure(run, parse_bytes(args.cap), dict(os.environ), args.timeout)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
