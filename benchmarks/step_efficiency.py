"""A memory-resident decode step against the probe's matmul peak measured beside it, alternated in one process.

    OMP_WAIT_POLICY=PASSIVE flock /tmp/flexh2o-timed.lock python benchmarks/step_efficiency.py --model opt-125m \
        --batch 64 --dtype float32 --rounds 3

Each round: Engine.generate with every weight, cache block and activation in the gpu tier (full cache, one GPU
batch), its decode seconds per step from its own timings; then the probe's matmul rates (tuning/probes.py:
compute_rates and matmul_rows_rates, quick), whose largest is the peak tuning/efficiency.peaks takes from a profile.
Prints per round the step's FLOPs (tuning/efficiency.step_flops), its rate and its % of that round's peak, and the
medians. A profile is measured once, maybe on a busier machine than the step: the peak measured beside the step
moves with the machine's load as the step does, so their ratio is what the run's own `efficiency` line means to say.
"""
from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from flexh2o.engine import Engine  # noqa: E402
from flexh2o.tuning.efficiency import step_flops  # noqa: E402
from flexh2o.tuning.probes import compute_rates, matmul_rows_rates  # noqa: E402
from resident import add_flags, prompts_and_config  # noqa: E402


def probe_peak(dtype: torch.dtype) -> float:
    """The largest matmul FLOP/s the quick probe measures for `dtype` now (as efficiency.peaks reads a profile)."""
    cpu = torch.device("cpu")
    rates = compute_rates(dtype, cpu, True)
    by_rows = matmul_rows_rates(dtype, cpu, True)
    return max([rates["matmul_flops"], rates["decode_matmul_flops"], *by_rows.values()])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flags(ap, prompt_len=32)
    ap.add_argument("--gen-len", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    prompts, rc = prompts_and_config(args, [100, 0, 100, 0, 100, 0], args.gen_len)
    flops = step_flops(rc, prefill=False)
    rows = []
    with Engine(rc) as eng:
        eng.generate(prompts, 2)  # warm-up
        for r in range(args.rounds):
            step = eng.generate(prompts, args.gen_len).decode_s / (args.gen_len - 1)
            peak = probe_peak(rc.compute)
            rows.append((step, flops / step, peak))
            print(f"round {r}: decode step {step * 1e3:.1f} ms, {flops / 1e9:.2f} GFLOP, {flops / step / 1e9:.1f} "
                  f"GFLOP/s; probe peak beside it {peak / 1e9:.1f} GFLOP/s: {100 * flops / step / peak:.0f}%")
    step, rate, peak = (statistics.median(c) for c in zip(*rows))
    pct = statistics.median(100 * f / p for _, f, p in rows)
    print(f"median: {args.model} batch {args.batch} {args.dtype}: step {step * 1e3:.1f} ms, {rate / 1e9:.1f} GFLOP/s, "
          f"peak {peak / 1e9:.1f} GFLOP/s, {pct:.0f}% of the peak measured beside it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
