"""Helpers shared by the benchmark scripts: the environment of a benchmark process, flexh2o-run as a subprocess,
points of a sweep as command-line flags, and plain-text tables. No state at module level."""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Optional

from memcap import MemCap

META_KEYS = ("label", "note")  # point keys that are not flexh2o-run flags
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench_env(threads: Optional[int] = None) -> dict:
    """Environment of every benchmark process: passive OpenMP waits (set before torch loads), offline hub."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def flag_args(point: dict) -> list:
    """{"gpu_batch_size": 8, "percent": "0 100 100 0", "cpu_cache_compute": true} -> flexh2o-run argv."""
    argv = []
    for key, value in point.items():
        if key in META_KEYS or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif key == "percent":
            argv += [flag] + str(value).split()
        else:
            argv += [flag, str(value)]
    return argv


def h2o_flags(hh_ratio: Optional[float], budget_pct: float, prompt_len: int, gen_len: int) -> dict:
    """H2O's flags: --hh-ratio when given, else the paper's "20%": a budget of budget_pct% of prompt + gen tokens
    (the authors' ratios 0.1 / 0.2 / 0.3 at 512+32 / 512+512 / 512+1024 keep about 20% of the sequence)."""
    if hh_ratio is not None:
        return {"kv_policy": "h2o", "hh_ratio": hh_ratio}
    return {"kv_policy": "h2o", "kv_budget": max(2, round(budget_pct / 100 * (prompt_len + gen_len)))}


def add_dtype_args(ap) -> None:
    """flexh2o's --dtype/--compute-dtype (default auto: flexh2o-run decides, planning/dtype_choice.py) and the
    peers' --peer-dtype (default auto: the dtype the probe finds fastest stored and computed alike)."""
    ap.add_argument("--dtype", default="auto", help="flexh2o's storage dtype (default auto)")
    ap.add_argument("--compute-dtype", default="auto", help="flexh2o's compute dtype (default auto)")
    ap.add_argument("--peer-dtype", default="auto", help="transformers/Accelerate dtype (default auto: fastest here)")


def add_h2o_args(ap) -> None:
    ap.add_argument("--budget-pct", type=float, default=20,
                    help="h2o budget as %% of prompt+gen tokens, split evenly heavy/recent (the paper's 20%%)")
    ap.add_argument("--hh-ratio", type=float, help="instead of --budget-pct: heavy = recent = int(r * prompt_len)")


def point_key(point: dict) -> str:
    """Canonical text of a point (what resumable runs compare)."""
    return json.dumps({k: v for k, v in point.items() if k not in META_KEYS}, sort_keys=True)


@dataclass
class Outcome:
    status: str  # ok, refused (exit 2: does not fit / bad flags), error, timeout
    record: Optional[dict] = None
    message: str = ""
    argv: list = field(default_factory=list)


def run_flexh2o(argv: list, timeout: float, env: dict, mem_cap: Optional[int] = None) -> Outcome:
    """One flexh2o-run process with its own --log-file; returns its JSON record. mem_cap: bytes, see memcap.py."""
    return _run([sys.executable, "-m", "flexh2o.cli"] + argv, "flexh2o-bench-", timeout, env, mem_cap)


def run_peer(argv: list, timeout: float, env: dict, mem_cap: Optional[int] = None) -> Outcome:
    """One benchmarks/baselines/hf_accelerate.py process (same record fields as flexh2o-run)."""
    script = os.path.join(REPO, "benchmarks", "baselines", "hf_accelerate.py")
    return _run([sys.executable, script] + argv, "hf-bench-", timeout, env, mem_cap)


def _run(cmd: list, prefix: str, timeout: float, env: dict, mem_cap: Optional[int]) -> Outcome:
    """Run cmd + --log-file (a temporary file), under a memory cgroup of mem_cap bytes when given; the record
    gets the cgroup's figures under "mem_cap"."""
    fd, log = tempfile.mkstemp(prefix=prefix, suffix=".jsonl")
    os.close(fd)
    shown = ["flexh2o-run" if c == "flexh2o.cli" else c for c in cmd if c not in (sys.executable, "-m")]
    cap = MemCap(mem_cap, os.path.basename(log)) if mem_cap else None
    try:
        try:
            p = subprocess.run(cmd + ["--log-file", log], env=env, capture_output=True, text=True,
                               timeout=timeout, cwd=REPO, preexec_fn=cap.preexec if cap else None)
        except subprocess.TimeoutExpired:
            return Outcome("timeout", None, f"over {timeout:.0f} s" + (f" (memory cgroup: {cap.stats()})" if cap
                                                                       else ""), shown)
        lines = [ln for ln in open(log) if ln.strip()]
        stats = cap.stats() if cap else None
        if p.returncode == 0 and lines:
            record = json.loads(lines[-1])
            if stats:
                record["mem_cap"] = stats
            return Outcome("ok", record, "", shown)
        if stats and p.returncode == -9:
            return Outcome("error", None, f"killed at the memory cap ({stats})", shown)
        tail = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        return Outcome("refused" if p.returncode == 2 else "error", None, tail, shown)
    finally:
        os.unlink(log)
        if cap:
            cap.close()


def dry_run_batches(argv: list, env: dict) -> dict:
    """{policy: largest batch} from `flexh2o-run ... --dry-run` (the chosen policy and, when not full, full)."""
    p = subprocess.run([sys.executable, "-m", "flexh2o.cli"] + argv + ["--dry-run"], env=env, capture_output=True,
                       text=True, cwd=REPO, timeout=300)
    m = re.search(r"largest --gpu-batch-size that fits: (.*)", p.stdout)
    if p.returncode != 0 or not m:
        raise RuntimeError(f"dry run failed: {p.stderr.strip() or p.stdout.strip()}")
    return {k: int(v) for k, v in (part.split() for part in m.group(1).split(","))}


def hardware_args(hw: Optional[str]) -> list:
    """flexh2o-run fills "predicted" (and the measured/predicted ratios) in every record itself from its cost model
    (default: its --hardware auto, this machine's cached profile); pass --hardware only when a profile is named."""
    return ["--hardware", hw] if hw else []


def load_avg() -> list:
    """1, 5 and 15 minute load averages (the machine is shared: recorded beside every measurement)."""
    return [round(x, 2) for x in os.getloadavg()]


def disk_read_probe(env: dict, offload_dir: Optional[str] = None) -> Optional[float]:
    """Direct-I/O read bandwidth of the disk tier right now (bytes/s; flexh2o.tuning.disk_probe.disk_rates: median
    of 5 reads of 256 MiB in 4 and 16 MiB files), in a child process with the benchmark environment; None when it
    cannot be measured."""
    where = offload_dir or os.path.join(os.path.expanduser("~"), "flexh2o_offload")
    code = ("import json, sys; from flexh2o.tuning.disk_probe import disk_rates; "
            "print(json.dumps(disk_rates(sys.argv[1], False, False)))")
    try:
        p = subprocess.run([sys.executable, "-c", code, where], env=env, capture_output=True, text=True, cwd=REPO,
                           timeout=120)
        return json.loads(p.stdout.strip().splitlines()[-1])["disk_read_bw"] if p.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError, IndexError, KeyError):
        return None


def gbs(rate: Optional[float]) -> str:
    return "-" if rate is None else f"{rate / 1e9:.2f} GB/s"


def regime(rec: dict) -> str:
    """'disk-streamed weights' when some weights live on disk (flexh2o: --percent weights-gpu + weights-cpu < 100;
    Accelerate: modules mapped to "disk"), else 'memory-resident'."""
    p = rec.get("policy") or {}
    if p.get("percent"):
        w = [float(x) for x in str(p["percent"]).split()[:2]]
        return "disk-streamed weights" if sum(w) < 100 else "memory-resident"
    place = p.get("placement") or {}
    return "disk-streamed weights" if "disk" in (place.get("devices_used") or []) else "memory-resident"


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def median(values: list) -> float:
    return statistics.median(values) if values else float("nan")


def table(rows: list, cols: list) -> str:
    """rows: dicts; cols: (header, key or function). Right-aligned plain text."""
    cells = [[h for h, _ in cols]]
    for r in rows:
        cells.append([str(f(r) if callable(f) else r.get(f, "")) for _, f in cols])
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells)


def describe_policy(rec: dict) -> str:
    p = rec["policy"]
    if p.get("kv_policy") in (None, "full"):
        return "full"
    return f"{p['kv_policy']} {p['heavy']}+{p['recent']}"
