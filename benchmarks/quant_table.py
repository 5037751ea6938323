"""Markdown tables for the quantized-cache runs (benchmarks/quant_runs.py's result files), against the plain
cache of a 1024-token policy table (same model, dtype, windows and prefix). Nothing is typed in by hand.

    python benchmarks/quant_table.py [--prefix acc26r] \
        [--plain benchmarks/results/ppl-by-policy/table_2026-12-02-a4eb387.json]

Tables: (1) the full cache per scheme and bits against the plain full cache; (2) h2o and the other policy at the
fixed budgets; (3) equal bytes: at the bytes of 64, 128 and 256 fp16 tokens, the best policy of each (scheme, bits)
at the token count quant_runs.equal_tokens gives, beside the plain cache's best at 64, 128 and 256 tokens.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quant_runs import equal_tokens, quant  # noqa: E402

FP16 = (64, 128, 256)


def load(prefix: str) -> dict:
    """(text, scheme, bits) -> result dict, from benchmarks/results/<prefix>_<text>_<scheme><bits>.json."""
    out = {}
    for path in glob.glob(os.path.join("benchmarks", "results", "quantized-kv-cache", f"{prefix}_*.json")):
        m = re.fullmatch(rf"{prefix}_([a-z_]+)_(new|flexgen|fitted|rotated)(\d)\.json", os.path.basename(path))
        if m:
            with open(path) as fh:
                out[m.group(1), m.group(2), int(m.group(3))] = json.load(fh)
    return out


def cell(ppl: float, ref: float) -> str:
    return f"{ppl:.3f} ({(ppl / ref - 1) * 100:+.2f}%)"


def rows_of(res: dict, text: str = None) -> dict:
    """(policy, budget tokens) -> ppl of a result's rows (of `text` only, when given)."""
    return {(r["policy"], r["budget_tokens"]): r["ppl"] for r in res["rows"] if text in (None, r["text"])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", default="acc26r")
    p.add_argument("--plain", default="benchmarks/results/ppl-by-policy/table_2026-12-02-a4eb387.json")
    p.add_argument("--recent", type=int, default=16)
    args = p.parse_args(argv)
    runs = load(args.prefix)
    with open(args.plain) as fh:
        plain = json.load(fh)
    pfull = {r["text"]: r["ppl"] for r in plain["rows"] if r["policy"] == "full"}
    runs = {k: v for k, v in runs.items() if k[0] in pfull}  # texts of the plain table (not the recall runs)
    texts = sorted({t for t, _, _ in runs})
    keys = sorted({(s, b) for _, s, b in runs}, key=lambda k: (k[0] != "new", -k[1]))
    print("Full cache against the plain full cache (" + ", ".join(f"{t} {pfull[t]:.3f}" for t in texts) + ")\n")
    print("| scheme | bits | " + " | ".join(texts) + " |\n|---|---|" + "---|" * len(texts))
    for s, b in keys:
        cells = [cell(rows_of(runs[t, s, b])[("full", None)], pfull[t]) if (t, s, b) in runs else "-" for t in texts]
        print(f"| {s} | {b} | " + " | ".join(cells) + " |")
    print("\nFixed budgets: each policy at 128 tokens, quantized, against the plain cache's same policy and budget\n")
    print("| text | cache | policy | 128 tokens | plain |\n|---|---|---|---|---|")
    for t in texts:
        prow = rows_of(plain, t)
        for s, b in keys:
            for (pol, bt), v in sorted(rows_of(runs[t, s, b]).items(), key=str) if (t, s, b) in runs else ():
                if bt == 128 and (pol, 128) in prow:
                    print(f"| {t} | {s} {b}-bit | {pol} | {cell(v, prow[pol, 128])} | {prow[pol, 128]:.3f} |")
    print("\nEqual bytes: the best policy at the bytes of N fp16 tokens (tokens kept in brackets), against the plain "
          "full cache\n")
    print("| text | cache | " + " | ".join(f"bytes of {n}" for n in FP16) + " |\n|---|---|" + "---|" * len(FP16))
    for t in texts:
        prow = rows_of(plain, t)
        cells = []
        for n in FP16:
            best = min((v, pol) for (pol, bt), v in prow.items() if bt == n)
            cells.append(f"{best[1]} {cell(best[0], pfull[t])} [{n}]")
        print(f"| {t} | plain | " + " | ".join(cells) + " |")
        for s, b in keys:
            if (t, s, b) not in runs:
                continue
            got, cells = rows_of(runs[t, s, b]), []
            for n in FP16:
                k = equal_tokens(quant(s, b, args.recent), n, 1024)
                cand = [(v, pol) for (pol, bt), v in got.items() if bt == k] or \
                    ([(got[("full", None)], "full")] if k >= 1024 else [])
                cells.append(f"{cand and min(cand)[1]} {cell(min(cand)[0], pfull[t])} [{k}]" if cand else "-")
            print(f"| {t} | {s} {b}-bit | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
