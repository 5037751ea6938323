"""The accuracy runs of the quantized KV cache: one `flexh2o-eval ppl` per (text, scheme, bits), run one
after another (nice 19: the evals are not timed), each writing
benchmarks/results/quantized-kv-cache/<prefix>_<text>_<scheme><bits>.json.

    python benchmarks/quant_runs.py --texts hamlet,macbeth --bits 4,3,2,8 --schemes new,flexgen [--dry]
    python benchmarks/quant_runs.py --prefix acc26f --full-only --group 32 ...   # the full cache alone

Lanes of every run: the full cache; h2o and `--other` at the fixed budgets `--fixed`, and at the token counts
whose K and V take the bytes of 64, 128 and 256 fp16 tokens under that run's layout (`equal_tokens`: kv/layout.py's
bytes a slot and a row, fp16 storage; a count reaching the context is the full cache, not run again). Schemes:
new = keys per channel with --key-outliers 8 and the first --cache-sinks 4 tokens exact (the defaults) and the
newest --recent tokens exact (the --compress-cache default); fitted = new with each channel's levels fitted to the
prompt (--cache-keys fitted); rotated = new with K and V quantized in a Hadamard-rotated basis (--cache-rotate);
flexgen = FlexGen's per-token keys, no window, no sinks.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Optional

import torch

from flexh2o.compress.defaults import cache_group
from flexh2o.kv.layout import DEFAULT_OUTLIERS, DEFAULT_RECENT, DEFAULT_SINKS, CacheLayout, CacheQuant

FP16_TOKEN = 2 * 64 * 2  # K and V bytes of one fp16 token of one SmolLM2 KV head (head_dim 64)
SCHEMES = {"new": dict(keys="channel", outliers=DEFAULT_OUTLIERS, sinks=DEFAULT_SINKS),
           "fitted": dict(keys="fitted", outliers=DEFAULT_OUTLIERS, sinks=DEFAULT_SINKS),
           "rotated": dict(keys="channel", outliers=DEFAULT_OUTLIERS, sinks=DEFAULT_SINKS, rotate=True),
           "flexgen": dict(keys="token", outliers=0, recent=0, sinks=0)}


def quant(scheme: str, bits: int, recent: int, group: Optional[int] = None) -> CacheQuant:
    """The scheme's CacheQuant; group None: the run's default group for its keys (compress/defaults.cache_group)."""
    kw = dict(SCHEMES[scheme])
    kw.setdefault("recent", recent)
    return CacheQuant(bits, cache_group(kw["keys"], None, group), **kw)


def equal_tokens(q: CacheQuant, fp16_tokens: int, context: int) -> int:
    """Tokens of one row and KV head whose K and V (slots plus the row's calibration and window) fit in the bytes of
    `fp16_tokens` fp16 tokens (at most the context)."""
    lay = CacheLayout(1, 1, context, 64, torch.float16, q)
    return min(context, (fp16_tokens * FP16_TOKEN - lay.kv_row_bytes()) // lay.kv_slot_bytes())


def command(text: str, q: CacheQuant, args) -> list:
    budgets = sorted({*args.fixed, *(equal_tokens(q, n, args.context) for n in (64, 128, 256))} - {args.context})
    lanes = ["--policies", "h2o", "--budgets", "100%"] if args.full_only else [
        "--policies", f"h2o,{args.other}", "--budgets", ",".join(map(str, budgets))]
    return ["flexh2o-eval", "ppl", "--model", "smollm2", "--dtype", "float32", "--context", str(args.context),
            "--windows", "1", "--texts", text, "--prefix", "64", *lanes, "--threads", str(args.threads),
            "--no-progress", "--compress-cache", "--compress-bits", str(q.bits), "--cache-group-size",
            str(q.group_size), "--cache-keys", q.keys, "--key-outliers", str(q.outliers), "--cache-recent",
            str(q.recent), "--cache-sinks", str(q.sinks), "--cache-rotate" if q.rotate else "--no-cache-rotate"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", default="hamlet,macbeth")
    p.add_argument("--bits", default="4,3,2,8")
    p.add_argument("--schemes", default="new,flexgen")
    p.add_argument("--recent", type=int, default=DEFAULT_RECENT)
    p.add_argument("--other", default="mean_vnorm", help="the policy besides h2o (default mean_vnorm)")
    p.add_argument("--fixed", default="128", help="fixed token budgets (default 128)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prefix", default="acc26r")
    p.add_argument("--group", type=int, default=None, help="--cache-group-size of every run (default: "
                   "flexh2o's for each scheme's keys, compress/defaults.cache_group)")
    p.add_argument("--full-only", action="store_true",
                   help="the full cache (and h2o at 100%%, the least eval takes beside it)")
    p.add_argument("--dry", action="store_true", help="print the commands only")
    args = p.parse_args(argv)
    args.fixed = [int(x) for x in args.fixed.split(",")]
    for text in args.texts.split(","):
        for bits in (int(b) for b in args.bits.split(",")):
            for scheme in args.schemes.split(","):
                q = quant(scheme, bits, args.recent, args.group)
                tag = f"{scheme}{bits}" + (f"g{q.group_size}" if q.group_size != 64 else "")
                out = f"benchmarks/results/quantized-kv-cache/{args.prefix}_{text}_{tag}.json"
                cmd = command(text, q, args) + ["--out", out]
                print(" ".join(cmd), flush=True)
                if args.dry or os.path.exists(out):
                    continue
                subprocess.run(["nice", "-n", "19", *cmd], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
