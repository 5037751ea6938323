"""The decode step with this tree's paths against the ones before them, alternated round by round in one process on
one Engine (memory-resident, full cache, one GPU batch): new = 16-bit products by oneDNN where the CPU multiplies
the dtype natively (models/common.onednn16_fits), one query's attention by matmuls in such a dtype
(kv/sdpa.one_query), the greedy choice over spans (sampling.greedy); old = F.linear, torch's fused attention for a
16-bit dtype, torch's argmax. fp32's products and attention are the same in both (only the argmax differs).

    OMP_WAIT_POLICY=PASSIVE flock /tmp/flexh2o-timed.lock python \
        benchmarks/results/step-efficiency/2026-12-07/ab_bf16_paths.py --model opt-125m --batch 128 --dtype bfloat16
"""
import argparse, statistics, sys, time
sys.path.insert(0, "benchmarks")
import torch
import torch.nn.functional as F
from flexh2o import sampling
from flexh2o.engine import Engine
from flexh2o.kv import decode
from flexh2o.models import common
from flexh2o.tuning.efficiency import step_flops
from resident import add_flags, prompts_and_config

ap = argparse.ArgumentParser(); add_flags(ap, 32)
ap.add_argument("--gen-len", type=int, default=8); ap.add_argument("--rounds", type=int, default=5)
args = ap.parse_args()
prompts, rc = prompts_and_config(args, [100, 0, 100, 0, 100, 0], args.gen_len)
new_sdpa, new_16, new_greedy = decode.sdpa, common.onednn_linear16, sampling.greedy
def old_sdpa(q, k, v, attn_mask=None, enable_gqa=False):
    if q.dtype == torch.float32:  # fp32's path is unchanged
        return new_sdpa(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)
def use(new):
    decode.sdpa = new_sdpa if new else old_sdpa
    common.onednn_linear16 = new_16 if new else (lambda dtype: False)
    sampling.greedy = new_greedy if new else (lambda logits: logits.argmax(-1))
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
