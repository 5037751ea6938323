"""Markdown perplexity tables for benchmarks/ACCURACY.md from `flexh2o-eval ppl` result files (parts of one table,
e.g. one file per text and budget group), with the best policy per text and budget and the targets it was measured against.

    python benchmarks/ppl_table.py benchmarks/results/ppl-by-policy/ppl1024_*.json [--key ppl_late]

Targets checked per text and budget: the best policy other than h2o and streaming against min(h2o, streaming), and
every policy against the full cache at 128 tokens (+5%).
"""
from __future__ import annotations

import argparse
import json
import sys

BASELINES = ("h2o", "streaming")


def merge(paths: list) -> tuple:
    """-> (rows keyed (text, policy, budget label), budget labels in table order, policies, context, seconds)."""
    rows, budgets, policies, seconds, context = {}, [], [], 0.0, None
    for path in paths:
        with open(path) as fh:
            res = json.load(fh)
        context = res["settings"]["context"]
        seconds += res["seconds"]
        for r in res["rows"]:
            rows[r["text"], r["policy"], r["budget"]] = r
            if r["policy"] != "full" and r["budget"] not in budgets:
                budgets.append(r["budget"])
            if r["policy"] != "full" and r["policy"] not in policies:
                policies.append(r["policy"])
    budgets.sort(key=lambda b: (b.endswith("%"), float(b.rstrip("%"))))
    return rows, budgets, policies, context, seconds


def tokens(rows: dict, budget: str) -> int:
    return next(r["budget_tokens"] for (_, _, b), r in rows.items() if b == budget)


def table(rows: dict, budgets: list, policies: list, text: str, key: str) -> list:
    full = rows[text, "full", "all"][key]
    head = [f"{b} ({tokens(rows, b)})" for b in budgets]
    out = [f"{text}: {key}, full cache {full:.3f}", "| policy | " + " | ".join(head) + " |",
           "|---|" + "---|" * len(head)]
    for p in policies:
        cells = [rows[text, p, b][key] for b in budgets]
        out.append(f"| {p} | " + " | ".join(f"{v:.3f} ({(v / full - 1) * 100:+.1f}%)" for v in cells) + " |")
    best = [min(policies, key=lambda p: rows[text, p, b][key]) for b in budgets]
    out.append("| **best** | " + " | ".join(f"**{p}**" for p in best) + " |")
    return out


def targets(rows: dict, budgets: list, policies: list, texts: list, key: str) -> list:
    """One line per text and budget: the best new policy against min(h2o, streaming), and who is within +5% of
    full at 128 tokens."""
    out, new = [], [p for p in policies if p not in BASELINES]
    for text in texts:
        full = rows[text, "full", "all"][key]
        for b in budgets:
            base = min(BASELINES, key=lambda p: rows[text, p, b][key])
            best = min(new, key=lambda p: rows[text, p, b][key])
            bv, nv = rows[text, base, b][key], rows[text, best, b][key]
            verdict = "met" if nv < bv else "MISSED"
            line = (f"- {text} {b}: best new {best} {nv:.3f} vs {base} {bv:.3f} ({(nv / bv - 1) * 100:+.1f}%): "
                    f"{verdict}")
            if tokens(rows, b) == 128:
                within = [p for p in policies if rows[text, p, b][key] <= 1.05 * full]
                line += f"; within +5% of full at 128: {', '.join(within) or 'none'}"
            out.append(line)
    return out


def single(rows: dict, budgets: list, policies: list, texts: list, key: str) -> list:
    """Per new policy: in how many (text, budget) cells it is below min(h2o, streaming), and below h2o, with its
    worst cell against h2o."""
    out = []
    cells = [(t, b) for t in texts for b in budgets]
    for p in (p for p in policies if p not in BASELINES):
        ratio = {c: rows[c[0], p, c[1]][key] / rows[c[0], "h2o", c[1]][key] for c in cells}
        below = sum(rows[t, p, b][key] < min(rows[t, q, b][key] for q in BASELINES) for t, b in cells)
        worst = max(cells, key=lambda c: ratio[c])
        out.append(f"- {p}: below min(h2o, streaming) in {below}/{len(cells)} cells, below h2o in "
                   f"{sum(r < 1 for r in ratio.values())}/{len(cells)}; worst against h2o: {worst[0]} {worst[1]} "
                   f"({(ratio[worst] - 1) * 100:+.1f}%)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--key", default="ppl", choices=["ppl", "ppl_late"])
    args = ap.parse_args(argv)
    rows, budgets, policies, context, seconds = merge(args.files)
    texts = list(dict.fromkeys(t for t, _, _ in rows))
    print(f"{context}-token windows; eval seconds summed over the files: {seconds:.0f}\n")
    for text in texts:
        print("\n".join(table(rows, budgets, policies, text, args.key)) + "\n")
    print("\n".join(targets(rows, budgets, policies, texts, args.key)) + "\n")
    print("\n".join(single(rows, budgets, policies, texts, args.key)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
