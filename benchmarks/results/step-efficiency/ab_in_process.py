"""The decode step with this tree's products and one-query attention against the previous path (MKL's F.linear /
the transposed product, relu and residual sums as their own passes, torch's fused attention kernel), alternated
round by round in one process on one Engine (opt-125m by default, memory-resident, full cache, one GPU batch).
--attention-only: the products left as they are, only the decode attention toggled (one query by two matmuls,
kv/sdpa.one_query, against torch's fused kernel). --bf16-paths (RESULTS rows 102-103): new = 16-bit products by
oneDNN where the CPU multiplies the dtype natively (models/common.onednn16_fits), one query's attention by matmuls in
such a dtype, the greedy choice over spans (sampling.greedy); old = F.linear, torch's fused attention for a 16-bit
dtype, torch's argmax; fp32's products and attention the same in both (only the argmax differs); the pair's order
swapped every round, 5 rounds unless --rounds is given.

    OMP_WAIT_POLICY=PASSIVE flock /tmp/flexh2o-timed.lock python \
        benchmarks/results/step-efficiency/ab_in_process.py --bf16-paths --model opt-125m --batch 128 --dtype bfloat16
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
ap.add_argument("--gen-len", type=int, default=8); ap.add_argument("--rounds", type=int)
ap.add_argument("--attention-only", action="store_true", help="toggle only the decode attention, not the products")
ap.add_argument("--bf16-paths", action="store_true", help="toggle the 16-bit products and attention and the argmax")
args = ap.parse_args()
args.rounds = args.rounds or (5 if args.bf16_paths else 7)
prompts, rc = prompts_and_config(args, [100, 0, 100, 0, 100, 0], args.gen_len)
new_sdpa, new_onednn = decode.sdpa, common.onednn_linear
new_16, new_greedy = common.onednn_linear16, sampling.greedy
def old_sdpa(q, k, v, attn_mask=None, enable_gqa=False):
    if args.bf16_paths and q.dtype == torch.float32:  # fp32's path is unchanged there
        return new_sdpa(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)
def use(new):
    decode.sdpa = new_sdpa if new else old_sdpa
    if args.bf16_paths:
        common.onednn_linear16 = new_16 if new else (lambda dtype: False)
        sampling.greedy = new_greedy if new else (lambda logits: logits.argmax(-1))
    elif not args.attention_only:  # else the products unchanged: only the attention toggled
        common.onednn_linear = new_onednn if new else (lambda: False)
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
        for name in (("old", "new") if args.bf16_paths and r % 2 else ("new", "old")):
            use(name == "new"); res[name].append(steps(eng))
        n, o = res["new"][-1], res["old"][-1]
        print(f"round {r}: new {n * 1e3:.1f} ms ({flops / n / 1e9:.1f} GFLOP/s), old {o * 1e3:.1f} ms "
              f"({flops / o / 1e9:.1f} GFLOP/s), old/new {o / n:.2f}", flush=True)
print(f"{args.model} batch {args.batch} {args.dtype}: median step new {statistics.median(res['new']) * 1e3:.1f} ms, "
      f"old {statistics.median(res['old']) * 1e3:.1f} ms; median of the paired old/new "
      f"{statistics.median(o / n for n, o in zip(res['new'], res['old'])):.2f}")
