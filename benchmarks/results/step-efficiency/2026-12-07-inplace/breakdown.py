"""Decode step of a memory-resident run with perf_counter around pieces (attention C code, head, emit, layers)."""
import sys, time, argparse, collections, statistics, os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, "benchmarks")
import torch
from flexh2o.engine import Engine
from flexh2o.kv import one_query_native as N, sdpa as S
from flexh2o.generation import sequences as SQ
from flexh2o.models import opt
import flexh2o.models.common as C
from resident import add_flags, prompts_and_config
ap = argparse.ArgumentParser(); add_flags(ap, 32); ap.add_argument("--gen-len", type=int, default=8)
ap.add_argument("--rounds", type=int, default=3)
args = ap.parse_args()
prompts, rc = prompts_and_config(args, [100, 0, 100, 0, 100, 0], args.gen_len)
acc = collections.Counter()
def timed(name, fn):
    def w(*a, **k):
        t = time.perf_counter(); r = fn(*a, **k); acc[name] += time.perf_counter() - t; return r
    return w
N.attend = timed("attention(C)", N.attend)
S.by_matmuls = timed("attention(matmuls)", S.by_matmuls)
opt.head = timed("head", opt.head)
opt.block = timed("blocks", opt.block)
opt._ln = timed("layernorm", opt._ln)
SQ.Sequences.emit = timed("emit", SQ.Sequences.emit)
for f in ("linear", "linear_add", "linear_relu"):
    setattr(opt, f, timed("products", getattr(opt, f)))
with Engine(rc) as eng:
    eng.generate(prompts, 2)
    for r in range(args.rounds):
        acc.clear(); ends = []
        def on(s):
            ends.append(time.perf_counter())
            if s == 0: acc.clear()
        eng.generate(prompts, args.gen_len, on_step=on)
        steps = [b - a for a, b in zip(ends, ends[1:])]
        n = args.gen_len - 1  # prefill + gen_len-1 decode steps are counted in acc; take per generate / gen_len roughly
        print(f"round {r}: decode step mean {statistics.fmean(steps)*1e3:.1f} ms (min {min(steps)*1e3:.1f}); per step of the generate (incl. prefill share / {n}): "
              + ", ".join(f"{k} {v / n * 1e3:.1f}" for k, v in acc.most_common()))
