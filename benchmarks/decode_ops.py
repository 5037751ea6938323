"""Where a decode step's time goes: torch.profiler over the decode steps of one flexh2o-run command, by aten op.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/decode_ops.py --top 12 -- --model opt-350m --percent 0 0 100 0 \
        --gpu-batch-size 16 --prompt-len 128 --gen-len 8 --no-warmup --compress-weight --compress-cache

The profiler starts at the first compute op of step 1 (prefill excluded) on the thread that computes, so the ops of
weight loads on the I/O threads are not counted; prints self milliseconds per decode step of the top ops (each op
with its input shapes, then summed by op name). Profiling slows small ops: compare ops with each other, not with the
run's own decode time.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import flexh2o.generation.run as generation_run  # noqa: E402
from flexh2o.cli.run import main as run_main  # noqa: E402


def profiled_run(argv: list) -> tuple:
    """(profiler, number of decode steps seen) after running flexh2o-run `argv` with the profiler on from step 1."""
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    steps: set = set()
    compute = generation_run.Run.compute

    def timed(run, op):
        if op.step >= 1:
            if not steps:
                prof.start()
            steps.add(op.step)
        return compute(run, op)
    generation_run.Run.compute = timed
    try:
        run_main(argv)
    finally:
        generation_run.Run.compute = compute
        if steps:
            prof.stop()
    return prof, len(steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--top", type=int, default=12)
    p.add_argument("run_args", nargs=argparse.REMAINDER, help="-- then flexh2o-run's arguments")
    args = p.parse_args()
    argv = args.run_args[1:] if args.run_args[:1] == ["--"] else args.run_args
    prof, steps = profiled_run(argv)
    if not steps:
        sys.exit("decode_ops: the run had no decode step (give --gen-len 2 or more)")
    events = prof.key_averages(group_by_input_shape=True)
    print(f"{steps} decode steps; self ms per step")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:args.top]:
        print(f"  {e.self_cpu_time_total / 1e3 / steps:8.1f}  {e.count / steps:6.1f} calls  {e.key}  "
              f"{e.input_shapes}")
    by_name: dict = collections.defaultdict(float)
    for e in events:
        by_name[e.key] += e.self_cpu_time_total / 1e3 / steps
    print("by op: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:args.top]))
    print(f"all ops: {sum(by_name.values()):.1f} ms per step")


if __name__ == "__main__":
    main()
