"""The decode step with this tree's products and one-query attention against the previous path (MKL's F.linear /
the transposed product, relu and residual sums as their own passes, torch's fused attention kernel), alternated
round by round in one process on one Engine (opt-125m by default, memory-resident, full cache, one GPU batch).
--attention-only: the products left as they are, only the decode attention toggled (one query by two matmuls,
kv/sdpa.one_query, against torch's fused kernel)."""
import argparse, statistics, sys, time
sys.path.insert(0, "benchmarks")
import torch
import torch.nn.functional as F
from flexh2o.engine import Engine
from flexh2o.kv import decode
from flexh2o.models import common
from flexh2o.tuning.efficiency import step_flops
from resident import add_flags, prompts_and_config

ap = argparse.ArgumentParser(); add_flags(ap, 32)
ap.add_argument("--gen-len", type=int, default=8); ap.add_argument("--rounds", type=int, default=7)
ap.add_argument("--attention-only", action="store_true", help="toggle only the decode attention, not the products")
args = ap.parse_args()
prompts, rc = prompts_and_config(args, [100, 0, 100, 0, 100, 0], args.gen_len)
new_sdpa, new_onednn = decode.sdpa, common.onednn_linear
def old_sdpa(q, k, v, attn_mask=None, enable_gqa=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)
def use(new):
    decode.sdpa = new_sdpa if new else old_sdpa
    if not args.attention_only:  # else the products unchanged: only the attention toggled
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
        for name in ("new", "old"):
            use(name == "new"); res[name].append(steps(eng))
        n, o = res["new"][-1], res["old"][-1]
        print(f"round {r}: new {n * 1e3:.1f} ms ({flops / n / 1e9:.1f} GFLOP/s), old {o * 1e3:.1f} ms "
              f"({flops / o / 1e9:.1f} GFLOP/s), old/new {o / n:.2f}", flush=True)
print(f"{args.model} batch {args.batch} {args.dtype}: median step new {statistics.median(res['new']) * 1e3:.1f} ms, "
      f"old {statistics.median(res['old']) * 1e3:.1f} ms; median of the paired old/new "
      f"{statistics.median(o / n for n, o in zip(res['new'], res['old'])):.2f}")
