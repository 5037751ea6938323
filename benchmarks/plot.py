"""Plots from benchmark records (JSON lines of flexh2o-run --log-file, sweep.py, compare.py, the peers).

    python benchmarks/plot.py benchmarks/results/paper-sweep/cpu_scaled.jsonl --out-dir benchmarks/plots

Writes <stem>_vs_batch.png (total throughput vs sequences per run), <stem>_vs_budget.png (throughput vs KV budget in
tokens per sequence) and, when records carry predicted figures, <stem>_measured_vs_predicted.png. Needs matplotlib
(the [bench] extra).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict

from bench_common import regime


def load(paths: list) -> list:
    recs = []
    for path in paths:
        with open(path) as f:
            recs += [json.loads(ln) for ln in f if ln.strip()]
    return [r for r in recs if r.get("total_throughput")]  # failed sweep points carry no measurement


def budget(rec: dict) -> int:
    """KV tokens kept per sequence (full keeps prompt + gen)."""
    p = rec["policy"]
    if p.get("kv_policy") in (None, "full"):
        return rec["prompt_len"] + rec["gen_len"]
    return (p.get("heavy") or 0) + (p.get("recent") or 0)


def system(rec: dict) -> str:
    if rec.get("system"):
        return rec["system"]
    p = rec["policy"]
    return "flexh2o full" if p["kv_policy"] == "full" else f"flexh2o {p['kv_policy']} {p['heavy']}+{p['recent']}"


def setting(rec: dict) -> str:
    """Model, lengths and regime (disk-streamed or memory-resident weights) with the placement that made it."""
    p = rec["policy"]
    where = p.get("percent") or (f"max_memory cpu {p['cpu_mem'] / 2**20:.0f} MiB"
                                 if rec.get("system") != "transformers" and p.get("cpu_mem") else "all in memory")
    cap = f" cgroup {rec['mem_cap']['limit'] / 2**30:.2f} GiB" if rec.get("mem_cap") else ""
    return f"{rec['model']} {rec['prompt_len']}+{rec['gen_len']} {regime(rec)} [{where}]{cap}"


def plot_vs_batch(plt, recs: list, path: str) -> None:
    """flexh2o: one line per setting through its points in batch order, each labelled with its KV policy (the
    median where a point ran several times); peers: one marker per setting."""
    ours, peers = defaultdict(lambda: defaultdict(list)), defaultdict(list)
    for r in recs:
        if r.get("system"):
            peers[f"{setting(r)} {system(r)}"].append((r["num_seqs"], r["total_throughput"]))
        else:
            ours[setting(r)][(r["num_seqs"], system(r).replace("flexh2o ", ""))].append(r["total_throughput"])
    fig, ax = plt.subplots(figsize=(10, 6))
    for name, pts in sorted(ours.items()):
        xs = sorted(pts)
        line, = ax.plot([x[0] for x in xs], [statistics.median(pts[x]) for x in xs], marker="o",
                        label=f"flexh2o, {name}")
        for x in xs:
            ax.annotate(x[1], (x[0], statistics.median(pts[x])), textcoords="offset points", xytext=(4, 4),
                        fontsize=7, color=line.get_color())
    for name, pts in sorted(peers.items()):
        for x, y in _median_by_x(pts):
            ax.plot([x], [y], marker="s", linestyle="none", label=name)
    ax.set(xlabel="sequences per run (gpu batch x num gpu batches)", ylabel="total throughput (generated tok/s)",
           title="Throughput vs batch size (each policy at the batch it ran)")
    _finish(fig, ax, path)


def plot_vs_budget(plt, recs: list, path: str) -> None:
    series = defaultdict(list)
    for r in recs:
        if not r.get("system"):
            series[setting(r)].append((budget(r), r["total_throughput"], r["num_seqs"]))
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, pts in sorted(series.items()):
        best = {}
        for b, tp, n in pts:  # the best throughput at each budget (each budget's batch may differ)
            if tp > best.get(b, (0, 0))[0]:
                best[b] = (tp, n)
        xs = sorted(best)
        ax.plot(xs, [best[x][0] for x in xs], marker="o", label=name)
        for x in xs:
            ax.annotate(f"b={best[x][1]}", (x, best[x][0]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set(xlabel="KV budget (tokens kept per sequence, layer and head)", ylabel="total throughput (tok/s)",
           title="Throughput vs KV budget (best batch per budget)")
    _finish(fig, ax, path)


def plot_predicted(plt, recs: list, path: str) -> bool:
    pts = [(r["predicted"][k], r[k], k, regime(r)) for r in recs for k in ("decode_throughput", "total_throughput")
           if (r.get("predicted") or {}).get(k)]
    if not pts:
        return False
    fig, ax = plt.subplots(figsize=(7, 7))
    for k, marker in (("decode_throughput", "o"), ("total_throughput", "s")):
        for reg, color in (("disk-streamed weights", "tab:red"), ("memory-resident", "tab:blue")):
            sel = [(p, m) for p, m, kk, rg in pts if kk == k and rg == reg]
            if sel:
                ax.scatter(*zip(*sel), marker=marker, color=color, facecolors="none" if k == "total_throughput"
                           else color, label=f"{k.replace('_', ' ')}, {reg}")
    hi = max(max(p, m) for p, m, _, _ in pts) * 1.1
    ax.plot([0, hi], [0, hi], "k-", lw=0.8, label="measured = predicted")
    ax.fill_between([0, hi], [0, 0.7 * hi], [0, 1.3 * hi], color="gray", alpha=0.15, label="within 30%")
    ax.plot([0, hi], [0, 0.8 * hi], "k--", lw=0.6, label="80% of the model (the decode target)")
    ax.set(xlabel="predicted (tok/s)", ylabel="measured (tok/s)", title="Measured vs predicted", xlim=(0, hi),
           ylim=(0, hi))
    _finish(fig, ax, path)
    return True


def _median_by_x(pts: list) -> list:
    by = defaultdict(list)
    for x, y in pts:
        by[x].append(y)
    return [(x, statistics.median(ys)) for x, ys in sorted(by.items())]


def _finish(fig, ax, path: str) -> None:
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Plot benchmark records to PNG.")
    ap.add_argument("results", nargs="+", help="JSON-lines files")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "plots"))
    ap.add_argument("--name", help="file name stem (default: the first results file's)")
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    recs = load(args.results)
    if not recs:
        print("no measured records to plot", file=sys.stderr)
        return 1
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, args.name or os.path.splitext(os.path.basename(args.results[0]))[0])
    plot_vs_batch(plt, recs, f"{stem}_vs_batch.png")
    plot_vs_budget(plt, recs, f"{stem}_vs_budget.png")
    if not plot_predicted(plt, recs, f"{stem}_measured_vs_predicted.png"):
        print("no predicted figures in these records: measured-vs-predicted plot skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
