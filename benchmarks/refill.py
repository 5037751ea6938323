"""Refill against FlexGen's fixed batches: N requests whose answers end at seeded lengths spread evenly
from --min-len to --max-len tokens (each request's max_new_tokens, no EOS), answered with refill (finished rows take
the next request inside the block schedule) or in fixed rounds of num_seqs requests (a round ends once all its rows
have finished). The batch is the largest that fits --gpu-mem for the policy (planning's one search) unless given.

Prints one JSON line: useful tokens (every request's answer), seconds of the job (engine built and warmed up
before the clock starts), useful tok/s, steps, rounds, batch.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/refill.py --policy h2o --refill true
    OMP_WAIT_POLICY=PASSIVE python benchmarks/refill.py --policy full --gpu-mem 48MB --refill both --repeats 5
    OMP_WAIT_POLICY=PASSIVE python benchmarks/refill.py --policy h2o --gpu-mem 48MB --refill both --percent "0 0 100 0"

The default placement keeps the weights in memory, so a step is mostly the engine's own small ops (the case least
kind to refill: a refilled row's prefill and the ragged rows' masked attention are extra work beside them);
`--percent "0 0 100 0"` streams the weights from the disk tier every step, the offloading engine's own regime,
where the weight pass a refilled prompt shares is the step's cost.

`--steps-only 4 18` prints the steps either way at those batches from the lengths alone (they equal the runs'),
the bound the batch puts on the ratio before any step's cost counts.
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench_common import median  # noqa: E402

from flexh2o.batch.run import run_requests  # noqa: E402
from flexh2o.batch.stopping import StopRule  # noqa: E402
from flexh2o.config import ModelConfig, from_name  # noqa: E402
from flexh2o.kv.spec import KVSpec  # noqa: E402
from flexh2o.placement import Percent  # noqa: E402
from flexh2o.planning.memory_plan import largest_batch  # noqa: E402
from flexh2o.requests import Request  # noqa: E402
from flexh2o.run_config import RunConfig  # noqa: E402
from flexh2o.units import parse_bytes  # noqa: E402

SMALL = ModelConfig("opt-small", "opt", hidden=256, num_layers=4, num_heads=4, ffn=1024, vocab=2048,
                    max_positions=512)  # a small OPT whose step is mostly the engine's own per-step work


def requests(n: int, prompt_len: int, lo: int, hi: int, vocab: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [Request(str(i), tuple(torch.randint(4, vocab, (prompt_len,), generator=g).tolist()), max_new_tokens=m)
            for i, m in enumerate(lens)]


def steps_of(lens: list, b: int) -> tuple:
    """(refill, fixed) steps of requests answering `lens` tokens on b rows, from the queue alone: a fixed round runs
    as long as its longest answer; with refill a row takes the next request the step after its own ends (the new
    prompt's prefill gives its first token), so the run lasts as long as the busiest row."""
    fixed = sum(max(lens[i:i + b]) for i in range(0, len(lens), b))
    rows = [0] * b
    for m in lens:
        heapq.heappush(rows, heapq.heappop(rows) + m)
    return max(rows), fixed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="'small' (the SMALL config above) or a built-in model name")
    p.add_argument("--policy", choices=("full", "h2o"), default="h2o")
    p.add_argument("--hh-ratio", type=float, default=0.2)
    p.add_argument("--refill", choices=("true", "false", "both"), default="true",
                   help="both: refill and fixed rounds alternated --repeats times on one engine (built and warmed "
                        "up once), each arm's median and the median of the pairs' ratios")
    p.add_argument("--repeats", type=int, default=3, help="pairs of runs under --refill both (default 3)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--min-len", type=int, default=8)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--percent", default="0 100 100 0", help="weights gpu, cpu; cache gpu, cpu (%%; the rest on disk)"
                   " as flexh2o-run --percent; default: weights in the cpu tier, cache in the gpu tier")
    p.add_argument("--offload-dir", default="/tmp", help="the disk tier's folder")
    p.add_argument("--gpu-mem", default="24MB", help="the gpu tier's capacity that sets each policy's largest batch")
    p.add_argument("--batch", type=int, default=None, help="GPU batch (default: the largest that fits)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps-only", type=int, nargs="+", metavar="BATCH", help="print the steps refill and fixed "
                   "rounds take at these batches (the queue's arithmetic, nothing run) and exit")
    a = p.parse_args()
    cfg = SMALL if a.model == "small" else from_name(a.model)
    kv = KVSpec.from_flags(a.policy, a.prompt_len, a.hh_ratio if a.policy == "h2o" else None, None, None)
    rc = RunConfig(model=cfg, percent=Percent.parse(a.percent.split()), gpu_batch_size=1, prompt_len=a.prompt_len,
                   gen_len=a.max_len, dtype=torch.float32, kv=kv, gpu_mem=parse_bytes(a.gpu_mem),
                   cpu_mem=parse_bytes("8GB"), offload_dir=a.offload_dir)
    rc = rc.with_(gpu_batch_size=a.batch or largest_batch(rc, limit=a.requests))
    reqs = requests(a.requests, a.prompt_len, a.min_len, a.max_len, cfg.vocab, a.seed)
    if a.steps_only:
        for b in a.steps_only:
            refill, fixed = steps_of([r.max_new_tokens for r in reqs], b)
            print(json.dumps({"batch": b, "refill_steps": refill, "fixed_steps": fixed,
                              "ratio": round(fixed / refill, 3)}))
        return
    if a.refill == "both":
        return alternate(rc, reqs, a)
    stats = run_requests(rc, reqs, StopRule(), refill=a.refill == "true")
    useful = sum(r.generated_tokens for r in stats.results)
    print(json.dumps({"policy": a.policy, "refill": a.refill == "true", "batch": rc.gpu_batch_size,
                      "useful_tokens": useful, "seconds": round(stats.seconds, 3),
                      "useful_tok_s": round(useful / stats.seconds, 2), "steps": stats.steps,
                      "rounds": stats.rounds}))


def alternate(rc: RunConfig, reqs: list, a) -> None:
    """Refill and fixed rounds in turn on one engine (pair i runs refill first when i is even), one JSON line per
    run and one for the medians: a drift of the machine's speed then falls on both arms alike."""
    from flexh2o.engine import Engine
    tok_s = {True: [], False: []}
    with Engine(rc) as eng:
        for i in range(a.repeats):
            for refill in ((True, False) if i % 2 == 0 else (False, True)):
                stats = run_requests(rc, reqs, StopRule(), refill=refill, engine=eng, warmup=i == 0)
                useful = sum(r.generated_tokens for r in stats.results)
                tok_s[refill].append(useful / stats.seconds)
                print(json.dumps({"policy": a.policy, "refill": refill, "pair": i, "batch": rc.gpu_batch_size,
                                  "useful_tokens": useful, "seconds": round(stats.seconds, 3),
                                  "useful_tok_s": round(useful / stats.seconds, 2), "steps": stats.steps}), flush=True)
    ratios = [r / f for r, f in zip(tok_s[True], tok_s[False])]  # in run order
    print(json.dumps({"policy": a.policy, "batch": rc.gpu_batch_size,
                      "refill_median": round(median(tok_s[True]), 2), "fixed_median": round(median(tok_s[False]), 2),
                      "pair_ratios": [round(r, 3) for r in ratios], "median_pair_ratio": round(median(ratios), 3)}))


if __name__ == "__main__":
    main()
