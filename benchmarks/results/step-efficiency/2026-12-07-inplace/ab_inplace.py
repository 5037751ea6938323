"""The decode step with this tree's paths against the ones before them, alternated round by round in one process on
one Engine (memory-resident, full cache, one GPU batch): new = one query's attention by kv/one_query_native.py's C
code over the cache block's slices where they lie, and the head's logits left in the compute dtype (converted by
Sequences.emit into its held fp32 record); old = kv/sdpa.by_matmuls (a 16-bit block's slices copied in row chunks,
two batched matmuls) and the head's logits converted to a fresh fp32 tensor. Rounds alternate, order swapped every
round; each round one generate's mean decode step.

    OMP_WAIT_POLICY=PASSIVE flock /tmp/flexh2o-timed.lock python \
        benchmarks/results/step-efficiency/2026-12-07-inplace/ab_inplace.py --model opt-125m --batch 128 --dtype bfloat16
"""
import argparse, statistics, sys, time
sys.path.insert(0, "benchmarks")
from flexh2o.engine import Engine
from flexh2o.kv import one_query_native
from flexh2o.models import opt
from flexh2o.tuning.efficiency import step_flops
from resident import add_flags, prompts_and_config

ap = argparse.ArgumentParser(); add_flags(ap, 32)
ap.add_argument("--gen-len", type=int, default=8); ap.add_argument("--rounds", type=int, default=5)
args = ap.parse_args()
prompts, rc = prompts_and_config(args, [100, 0, 100, 0, 100, 0], args.gen_len)
new_takes, new_head = one_query_native.takes, opt.head
def use(new):
    one_query_native.takes = new_takes if new else (lambda q, k, v: False)
    opt.head = new_head if new else (lambda cfg, w, x: new_head(cfg, w, x).float())
def steps(eng):
    ends = []
    eng.generate(prompts, args.gen_len, on_step=lambda s: ends.append(time.perf_counter()))
    return statistics.fmean(b - a for a, b in zip(ends, ends[1:]))
flops = step_flops(rc, False)
res = {"new": [], "old": []}
with Engine(rc) as eng:
    for new in (True, False):
        use(new); eng.generate(prompts, 2)
    for r in range(args.rounds):
        for name in (("new", "old") if r % 2 == 0 else ("old", "new")):
            use(name == "new"); res[name].append(steps(eng))
        n, o = res["new"][-1], res["old"][-1]
        print(f"round {r}: new {n * 1e3:.1f} ms ({flops / n / 1e9:.1f} GFLOP/s), old {o * 1e3:.1f} ms "
              f"({flops / o / 1e9:.1f} GFLOP/s), old/new {o / n:.2f}", flush=True)
print(f"{args.model} batch {args.batch} {args.dtype}: median step new {statistics.median(res['new']) * 1e3:.1f} ms, "
      f"old {statistics.median(res['old']) * 1e3:.1f} ms; median of the paired old/new "
      f"{statistics.median(o / n for n, o in zip(res['new'], res['old'])):.2f}")
