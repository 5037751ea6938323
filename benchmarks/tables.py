"""Markdown tables for benchmarks/RESULTS.md, computed from the result files (nothing typed in by hand).

    python benchmarks/tables.py                      # the known files under benchmarks/results/<question>/
    python benchmarks/tables.py --compare benchmarks/results/peers/compare_disk.jsonl
    python benchmarks/tables.py --h2o-vs-full none --sweep none --compare \
        --runs benchmarks/results/cost-model-vs-measured/policy_auto.jsonl

h2o_vs_full.jsonl: its last full/h2o pair. <sweep>.jsonl: every point. compare*.jsonl: the latest run (run_id) in the
file, medians over its rounds and the ratios of the medians. "decode / disk bound" divides the time the disk tier
needs per decode step (bytes read from disk per step over the read rate probed just before, direct I/O) by the
measured time per step: 1.0 means decode ran at the disk's speed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict

from bench_common import regime

HERE = os.path.dirname(os.path.abspath(__file__))


def load(path: str) -> list:
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def md(rows: list, cols: list) -> str:
    out = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(str(f(r)) for _, f in cols) + " |")
    return "\n".join(out)


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def step_s(r: dict) -> float:
    return r["decode_s"] / max(r["gen_len"] - 1, 1)


def disk_bound_ratio(r: dict, probe) -> str:
    disk = (r.get("moved_bytes_per_step") or {}).get("disk")
    if not disk or not probe:
        return "-"
    return f"{disk / probe / step_s(r):.2f}"


def pred(r: dict, key: str, fmt: str = "{:.1f}") -> str:
    v = (r.get("predicted") or {}).get(key)
    return "-" if v is None else fmt.format(v)


def ratio(r: dict, key: str) -> str:
    v = r.get(key)
    return "-" if v is None else f"{v:.2f}"


def bottleneck(r: dict) -> str:
    return ((r.get("predicted") or {}).get("bottleneck") or {}).get("decode", "-")


def load_s(r: dict, where: str) -> str:
    meta = r.get(where) or {}
    b, a = meta.get("loadavg_before"), meta.get("loadavg_after")
    return f"{b[0]:.1f}/{a[0]:.1f}" if b and a else "-"


def kv(r: dict) -> str:
    p = r["policy"]
    if p.get("kv_policy") in (None, "full"):
        return "full"
    return f"{p['kv_policy']} {p['heavy']}+{p['recent']}"


RUN_COLS = [("batch", lambda r: r["num_seqs"]), ("kv", kv),
            ("prefill s", lambda r: f"{r['prefill_s']:.2f}"), ("decode s", lambda r: f"{r['decode_s']:.2f}"),
            ("s/step", lambda r: f"{step_s(r):.3f}"),
            ("total tok/s", lambda r: f"{r['total_throughput']:.1f}"),
            ("decode tok/s", lambda r: f"{r['decode_throughput']:.1f}"),
            ("model total", lambda r: pred(r, "total_throughput")),
            ("model decode", lambda r: pred(r, "decode_throughput")),
            ("decode meas/model", lambda r: ratio(r, "decode_ratio_measured_to_predicted")),
            ("model bottleneck", bottleneck)]


def h2o_vs_full(path: str) -> str:
    recs = load(path)[-2:]
    cols = [("policy", kv)] + RUN_COLS[:1] + [
        ("cache slots", lambda r: r["prompt_len"] + r["gen_len"] if kv(r) == "full"
         else f"{r['policy']['heavy']}+{r['policy']['recent']}+1")] + RUN_COLS[2:] + [
        ("decode / disk bound", lambda r: disk_bound_ratio(r, r["bench"].get("disk_read_bw_probe"))),
        ("peak gpu MiB", lambda r: mib(r["peak_bytes"]["gpu"])),
        ("peak cpu tier MiB", lambda r: mib(r["peak_bytes"]["cpu_tier"])),
        ("peak disk MiB", lambda r: mib(r["peak_bytes"]["disk"])),
        ("disk read/step MiB", lambda r: mib(r["moved_bytes_per_step"].get("disk"))),
        ("peak RSS MiB", lambda r: mib(r["peak_bytes"]["cpu_rss"])), ("load 1m before/after",
                                                                       lambda r: load_s(r, "bench"))]
    text = md(recs, cols)
    if len(recs) == 2 and kv(recs[0]) == "full":
        f, h = recs
        text += (f"\n\nh2o / full: batch {h['num_seqs'] / f['num_seqs']:.2f}x, total throughput "
                 f"{h['total_throughput'] / f['total_throughput']:.2f}x, decode throughput "
                 f"{h['decode_throughput'] / f['decode_throughput']:.2f}x; disk probe "
                 f"{(f['bench'].get('disk_read_bw_probe') or 0) / 1e9:.2f} GB/s")
    return text


def sweep(path: str) -> str:
    recs = [r for r in load(path) if "sweep" in r]
    ok = [r for r in recs if r["sweep"]["status"] == "ok"]
    cols = [("group", lambda r: r["sweep"]["label"]), ("len", lambda r: f"{r['prompt_len']}+{r['gen_len']}")] + \
        RUN_COLS + [("decode / disk bound", lambda r: disk_bound_ratio(r, r["sweep"].get(
            "disk_read_bw_probe_at_start"))), ("peak gpu MiB", lambda r: mib(r["peak_bytes"]["gpu"])),
                    ("load 1m before/after", lambda r: load_s(r, "sweep"))]
    text = md(ok, cols)
    bad = [r for r in recs if r["sweep"]["status"] != "ok"]
    if bad:
        text += "\n\nNot measured: " + "; ".join(f"{' '.join(r['sweep']['argv'])}: {r['sweep']['status']} "
                                                 f"{r['sweep']['message']}" for r in bad)
    pairs = defaultdict(dict)
    for r in ok:
        if r["sweep"]["label"] in ("disk-streamed", "memory-resident"):
            pairs[(r["sweep"]["label"], r["gen_len"])][kv(r) == "full"] = r
    lines = []
    for (label, gen), pr in sorted(pairs.items()):
        if True in pr and False in pr:
            f, h = pr[True], pr[False]
            lines.append(f"- {label} 128+{gen}: h2o / full batch {h['num_seqs'] / f['num_seqs']:.2f}x, total "
                         f"{h['total_throughput'] / f['total_throughput']:.2f}x, decode "
                         f"{h['decode_throughput'] / f['decode_throughput']:.2f}x")
    return text + ("\n\n" + "\n".join(lines) if lines else "")


def compare(path: str) -> str:
    recs = load(path)
    run_id = max(r["compare"]["run_id"] for r in recs)
    recs = [r for r in recs if r["compare"]["run_id"] == run_id]
    failed = [r for r in recs if r.get("status", "ok") != "ok"]  # compare.py records runs that did not finish too
    recs = [r for r in recs if r.get("status", "ok") == "ok"]
    by = defaultdict(list)
    for r in recs:
        by[r["compare"]["system"]].append(r)
    med = statistics.median

    def row(system: str, rs: list) -> dict:
        tps = [r["total_throughput"] for r in rs]
        ratios = [r["decode_ratio_measured_to_predicted"] for r in rs if r.get("decode_ratio_measured_to_predicted")]
        bounds = [disk_bound_ratio(r, r["compare"].get("disk_read_bw_probe")) for r in rs]
        bounds = [float(b) for b in bounds if b != "-"]
        place = rs[0]["policy"].get("placement") or {}
        where = (f"--percent {rs[0]['policy']['percent']}" if rs[0]["policy"].get("percent") else
                 "+".join(place.get("devices_used") or ["memory"]) + (
                     f" ({mib(place.get('weight_bytes_on_disk'))} MiB on disk)"
                     if "disk" in (place.get("devices_used") or []) else ""))
        return {"system": system, "where": where, "n": len(rs), "batch": rs[0]["num_seqs"],
                "kv": kv(rs[0]) if system in ("full", "h2o") else "full (HF)", "total": med(tps),
                "spread": f"{min(tps):.1f}-{max(tps):.1f}", "prefill": med([r["prefill_s"] for r in rs]),
                "decode": med([r["decode_s"] for r in rs]), "dec_tp": med([r["decode_throughput"] for r in rs]),
                "ratio": f"{med(ratios):.2f}" if ratios else "-",
                "ratios": ", ".join(f"{x:.2f}" for x in ratios) if ratios else "-",
                "bound": f"{med(bounds):.2f}" if bounds else "-",
                "pred": f"{med([r['predicted']['decode_throughput'] for r in rs]):.1f}" if ratios else "-",
                "bottleneck": bottleneck(rs[0]) if ratios else "-",
                "rss": mib(max(r["peak_bytes"]["cpu_rss"] for r in rs)),
                "gpu": mib(max(r["peak_bytes"]["gpu"] or 0 for r in rs)),
                "load": f"{min(r['compare']['loadavg_before'][0] for r in rs):.1f}-"
                        f"{max(r['compare']['loadavg_before'][0] for r in rs):.1f}",
                "cg": mib(max(r["mem_cap"]["peak_charged"] or 0 for r in rs)) if rs[0].get("mem_cap") else "-",
                "cg_hits": str(max(r["mem_cap"]["times_at_limit"] or 0 for r in rs)) if rs[0].get("mem_cap")
                else "-"}
    order = [s for s in ("full", "h2o", "accelerate", "transformers") if s in by]
    rows = {s: row(s, by[s]) for s in order}
    cols = [("system", lambda r: r["system"]), ("weights", lambda r: r["where"]), ("runs", lambda r: r["n"]),
            ("batch", lambda r: r["batch"]), ("kv", lambda r: r["kv"]),
            ("median total tok/s", lambda r: f"{r['total']:.1f}"), ("min-max", lambda r: r["spread"]),
            ("prefill s", lambda r: f"{r['prefill']:.2f}"), ("decode s", lambda r: f"{r['decode']:.2f}"),
            ("decode tok/s", lambda r: f"{r['dec_tp']:.1f}"), ("model decode tok/s", lambda r: r["pred"]),
            ("decode meas/model (per round)", lambda r: f"{r['ratio']} ({r['ratios']})"),
            ("model bottleneck", lambda r: r["bottleneck"]), ("decode / disk bound", lambda r: r["bound"]),
            ("peak gpu MiB", lambda r: r["gpu"]), ("peak RSS MiB", lambda r: r["rss"]),
            ("load 1m", lambda r: r["load"])]
    if any(r.get("mem_cap") for r in recs):
        cols[-1:-1] = [("cgroup peak MiB", lambda r: r["cg"]), ("times at cap", lambda r: r["cg_hits"])]
    r0 = (recs or failed)[0]
    head = (f"run {run_id}: {r0['model']} {r0.get('prompt_len', '?')}+{r0.get('gen_len', '?')}, "
            + (f"{regime(by['full'][0])}, " if 'full' in by else "") +
            f"{max([len(v) for v in by.values()] + [1 + r['compare']['round'] for r in failed])} rounds; disk probe "
            "per round "
            + ", ".join(sorted({f"{r['compare']['disk_read_bw_probe'] / 1e9:.2f}" for r in recs
                                if r["compare"].get("disk_read_bw_probe")})) + " GB/s")
    lines = []
    for a, b in (("full", "accelerate"), ("full", "transformers"), ("h2o", "full"), ("h2o", "accelerate")):
        if a in by and b in by:
            pa = {r["compare"]["round"]: r["total_throughput"] for r in by[a]}
            pb = {r["compare"]["round"]: r["total_throughput"] for r in by[b]}
            per = [pa[k] / pb[k] for k in sorted(pa) if k in pb]
            lines.append(f"- {a} / {b}: **{rows[a]['total'] / rows[b]['total']:.2f}x** (ratio of medians; per round "
                         f"{', '.join(f'{x:.2f}' for x in per)})")
    for r in failed:
        m = r["compare"]
        lines.append(f"- {m['system']} round {m['round'] + 1} did not finish: {r['status']} ({r['message']})")
    cap = r0["compare"].get("mem_cap")
    if cap:
        head += f"; every process in a memory cgroup of {cap / 2**30:.2f} GiB (memory + page cache)"
    body = md([rows[s] for s in order], cols) if order else "(no run finished)"
    return head + "\n\n" + body + "\n\n" + "\n".join(lines)


def runs(path: str) -> str:
    """Plain flexh2o-run records (e.g. --log-file of hand-run commands), one row each, in file order."""
    cols = [("percent", lambda r: r["policy"]["percent"]),
            ("batch", lambda r: f"{r['policy']['gpu_batch_size']}x{r['policy']['num_gpu_batches']}")] + RUN_COLS[1:]
    return md(load(path), cols)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Markdown tables from benchmark result files.")
    res = os.path.join(HERE, "results")
    ap.add_argument("--h2o-vs-full", default=os.path.join(res, "h2o-vs-full", "h2o_vs_full.jsonl"))
    ap.add_argument("--sweep", default=os.path.join(res, "paper-sweep", "cpu_scaled.jsonl"))
    ap.add_argument("--compare", nargs="*", default=[os.path.join(res, "peers", f"compare_{v}.jsonl")
                                                     for v in ("disk", "memory")])
    ap.add_argument("--runs", nargs="*", default=[], help="files of plain flexh2o-run records")
    args = ap.parse_args(argv)
    for title, path, fn in ([("h2o_vs_full", args.h2o_vs_full, h2o_vs_full), ("sweep", args.sweep, sweep)]
                            + [("compare", p, compare) for p in args.compare] + [("runs", p, runs) for p in args.runs]):
        if path and os.path.exists(path):
            print(f"### {title}: {os.path.relpath(path, os.path.dirname(HERE))}\n\n{fn(path)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
