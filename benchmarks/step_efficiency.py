"""A memory-resident decode step against the probe's matmul peak measured beside it, alternated in one process.

    OMP_WAIT_POLICY=PASSIVE flock /tmp/flexh2o-timed.lock python benchmarks/step_efficiency.py --model opt-125m \
        --batch 64 --dtype float32 --rounds 3

Each round: Engine.generate with every weight, cache block and activation in the gpu tier (full cache, one GPU
batch), its decode seconds per step from its own timings; then the probe's matmul rates (tuning/probes.py:
compute_rates and matmul_rows_rates, quick), whose largest is the peak tuning/efficiency.peaks takes from a profile;
then the step's own matmuls (tuning/efficiency.decode_matmuls: every weight shape it multiplies, as many copies as
it holds, at its rows) by the engine's models/common.linear: the rate the step's shapes reach on this CPU.
Prints per round the step's FLOPs (tuning/efficiency.step_flops), its rate and its % of that round's peak, the
same for its fastest half of steps (the estimator the probe's rates use: tuning/probes.median_time), the probe's
rates by kind and the shapes' rate, and the medians. A profile is measured once, maybe on a busier machine than the
step: the peak measured beside the step moves with the machine's load as the step does, so their ratio is what the
run's own `efficiency` line means to say.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from flexh2o.engine import Engine  # noqa: E402
from flexh2o.models.common import linear  # noqa: E402
from flexh2o.tuning.efficiency import decode_matmuls, step_flops  # noqa: E402
from flexh2o.tuning.probes import compute_rates, matmul_rows_rates, median_time  # noqa: E402
from resident import add_flags, prompts_and_config  # noqa: E402


def probe_rates(dtype: torch.dtype) -> dict:
    """The quick probe's matmul FLOP/s for `dtype` now by kind (the largest is the peak efficiency.peaks reads)."""
    cpu = torch.device("cpu")
    rates = compute_rates(dtype, cpu, True)
    by_rows = matmul_rows_rates(dtype, cpu, True)
    return {"square": rates["matmul_flops"], "decode32": rates["decode_matmul_flops"],
            **{f"rows{r}": f for r, f in by_rows.items()}}


def shapes_rate(rc) -> float:
    """FLOP/s of the step's own matmuls (efficiency.decode_matmuls) at its rows by models/common.linear: per shape,
    a pass over as many distinct weights as the step multiplies (median of the faster half of 3), summed."""
    rows, flops, seconds = rc.gpu_batch_size, 0.0, 0.0
    for (n, k), count in decode_matmuls(rc).items():
        ws = [torch.randn(n, k).to(rc.compute) for _ in range(count)]  # (out, in) each, as the step streams them
        x = torch.randn(rows, 1, k).to(rc.compute)  # (b, 1, in): one decode token a row
        seconds += median_time(lambda: [linear(x, w) for w in ws], 3)
        flops += 2.0 * rows * n * k * count
        del ws
    return flops / seconds


def decode_steps(eng, prompts, gen_len: int) -> list:
    """Seconds of each decode step of one Engine.generate (from the step ends it announces)."""
    ends = []
    eng.generate(prompts, gen_len, on_step=lambda step: ends.append(time.perf_counter()))
    return [b - a for a, b in zip(ends, ends[1:])]


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
            steps = sorted(decode_steps(eng, prompts, args.gen_len))
            step, fast = statistics.fmean(steps), statistics.median(steps[:max(1, len(steps) // 2)])
            rates = probe_rates(rc.compute)
            peak, shapes = max(rates.values()), shapes_rate(rc)
            rows.append((step, flops / step, peak, fast, shapes))
            print(f"round {r}: decode step {step * 1e3:.1f} ms, {flops / 1e9:.2f} GFLOP, {flops / step / 1e9:.1f} "
                  f"GFLOP/s; probe peak beside it {peak / 1e9:.1f} GFLOP/s: {100 * flops / step / peak:.0f}%; "
                  f"fastest half of its steps {fast * 1e3:.1f} ms: {100 * flops / fast / peak:.0f}%; the step's "
                  f"matmul shapes alone {shapes / 1e9:.1f} GFLOP/s ({100 * shapes / peak:.0f}% of the peak); probe: "
                  + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in rates.items()))
    step, rate, peak, fast, shapes = (statistics.median(c) for c in zip(*rows))
    pct = statistics.median(100 * f / p for _, f, p, _, _ in rows)
    print(f"median: {args.model} batch {args.batch} {args.dtype}: step {step * 1e3:.1f} ms, {rate / 1e9:.1f} GFLOP/s, "
          f"peak {peak / 1e9:.1f} GFLOP/s, {pct:.0f}% of the peak measured beside it; fastest half of the steps "
          f"{statistics.median(100 * flops / x / p for _, _, p, x, _ in rows):.0f}%; the step's matmul shapes alone "
          f"{shapes / 1e9:.1f} GFLOP/s, {statistics.median(100 * s / p for _, _, p, _, s in rows):.0f}% of the peak")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
