"""Soak benchmark (not a test): one long H2O decode on a tiny seeded model with weights on all three tiers
and the KV cache in the cpu tier. Samples the process RSS and every tier's bytes in use every --every steps, fits a
least-squares line to each (after the first --skip samples: allocator warm-up), writes a JSON record and a PNG.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/soak.py --steps 10000

The slope must be flat: with a fixed KV budget nothing the run holds may grow with the number of decode steps
(beyond the preallocated (num_seqs, gen_len) token table, which is allocated before the first step).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import psutil
import torch

from flexh2o.config import ModelConfig
from flexh2o.engine import Engine
from flexh2o.kv.spec import KVSpec
from flexh2o.placement import Percent
from flexh2o.run_config import RunConfig

HERE = os.path.dirname(os.path.abspath(__file__))


def slope(xs: list, ys: list) -> float:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def fingerprint() -> dict:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        lscpu = ""
    info = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = info.get("Flags", "").split()
    return {"cpu": info.get("Model name", platform.processor()).strip(), "cpus": os.cpu_count(),
            "avx2": "avx2" in flags, "avx512f": "avx512f" in flags, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", ""),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "")}


def run(args) -> dict:
    steps, load_before = args.steps, list(os.getloadavg())
    cfg = ModelConfig(name="soak-opt", family="opt", hidden=args.hidden, num_layers=args.layers, num_heads=4,
                      ffn=4 * args.hidden, vocab=args.vocab, max_positions=args.prompt_len + steps)
    kv = KVSpec.from_flags("h2o", args.prompt_len, kv_budget=args.budget)
    rc = RunConfig(model=cfg, percent=Percent(50, 25, 0, 100, 100, 0), gpu_batch_size=args.batch,
                   prompt_len=args.prompt_len, gen_len=steps, dtype=torch.float32, kv=kv, gpu_mem=1 << 30,
                   cpu_mem=1 << 30, disk_mem=1 << 30, offload_dir=args.offload_dir)
    proc, samples = psutil.Process(), []
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, cfg.vocab, (rc.num_seqs, args.prompt_len), generator=g).tolist()
    with Engine(rc) as eng:
        start = time.perf_counter()

        def on_step(step):
            if step % args.every == 0 or step == steps - 1:
                row = {"step": step, "rss": proc.memory_info().rss, "s": time.perf_counter() - start}
                row.update({f"{t}_used": tier.used for t, tier in eng.tiers.items()})
                samples.append(row)
        gen = eng.generate(prompts, steps, on_step=on_step)
    kept = samples[args.skip:]
    xs = [r["step"] for r in kept]
    fits = {k: slope(xs, [r[k] for r in kept]) for k in kept[0] if k not in ("step", "s")}
    return {"argv": sys.argv[1:], "steps": steps, "every": args.every, "skip": args.skip, "model": cfg.__dict__,
            "percent": str(rc.percent), "batch": rc.num_seqs, "kv_budget": args.budget,
            "cache_slots": rc.kv.slots(args.prompt_len, steps, rc.model.num_layers), "decode_s": gen.decode_s,
            "slope_bytes_per_step": fits, "rss_first": kept[0]["rss"], "rss_last": kept[-1]["rss"],
            "rss_max": max(r["rss"] for r in samples), "samples": samples,
            "machine": {**fingerprint(), "loadavg_before": load_before, "loadavg_after": list(os.getloadavg())}}


def plot(rec: dict, path: str) -> None:
    """RSS (MiB, top) and each tier's bytes in use (KiB, bottom) against the decode step, with the fitted slopes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s, fit = rec["samples"], rec["slope_bytes_per_step"]
    steps = [r["step"] for r in s]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, [r["rss"] / 2 ** 20 for r in s], label=f"process RSS (slope {fit['rss']:+.1f} B/step)")
    top.set_ylabel("MiB")
    top.set_ylim(bottom=0)
    for t in ("gpu", "cpu", "disk"):
        k = f"{t}_used"
        if k in s[0]:
            bottom.plot(steps, [r[k] / 2 ** 10 for r in s], label=f"{t} tier in use (slope {fit[k]:+.2f} B/step)")
    bottom.set_ylabel("KiB")
    bottom.set_xlabel("decode step")
    bottom.set_ylim(bottom=0)
    top.set_title(f"soak: {rec['steps']} H2O decode steps, budget {rec['kv_budget']} tokens, batch {rec['batch']}, "
                  f"percent {rec['percent']}", fontsize=9)
    for ax in (top, bottom):
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--skip", type=int, default=2, help="samples left out of the fit (warm-up)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--budget", type=int, default=64, help="H2O budget in tokens (heavy + recent)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--offload-dir", default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "memory-over-a-long-run", "soak.json"))
    ap.add_argument("--plot", default=os.path.join(HERE, "plots", "soak.png"))
    ap.add_argument("--replot", action="store_true", help="only redraw --plot from the record at --out")
    args = ap.parse_args()
    if args.replot:
        with open(args.out) as f:
            plot(json.load(f), args.plot)
        return 0
    with tempfile.TemporaryDirectory(prefix="flexh2o-soak-") as tmp:
        args.offload_dir = args.offload_dir or tmp
        rec = run(args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    plot(rec, args.plot)
    fit = rec["slope_bytes_per_step"]
    print(f"soak: {rec['steps']} steps in {rec['decode_s']:.0f} s; RSS {rec['rss_first'] / 2 ** 20:.1f} -> "
          f"{rec['rss_last'] / 2 ** 20:.1f} MiB (max {rec['rss_max'] / 2 ** 20:.1f}); slopes (bytes/step): "
          + ", ".join(f"{k} {v:+.2f}" for k, v in fit.items()) + f"; wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
