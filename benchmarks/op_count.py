"""Framework calls per decode step, flexh2o against plain transformers, counted (not timed: the count does not
depend on the machine's load).

    python benchmarks/op_count.py --model opt-125m --batch 8 --prompt-len 64

Counts the top-level aten calls (torch.profiler) of one decode step of a memory-resident flexh2o run (weights in the
cpu tier, cache and activations on the compute side, --dtype (fp32 by default), one GPU batch, overlap off, KV
policy full) as the
difference between generations of 3 and 2 tokens, and of one cached forward of transformers' OPTForCausalLM on the
same weights. Each call costs a few microseconds of dispatch whatever its size, so at small batches the difference
is overhead an offloading engine should not add. Prints the totals and the most frequent calls of each.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from conftest import hf_opt  # noqa: E402
from flexh2o.engine import Engine  # noqa: E402
from resident import add_flags, prompts_and_config  # noqa: E402


def top_level_calls(fn) -> collections.Counter:
    """aten call name -> count, of the calls fn makes that no other aten call made."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    out: collections.Counter = collections.Counter()
    for e in prof.events():
        parent = e.cpu_parent
        if e.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::")):
            out[e.name] += 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flags(ap, prompt_len=64)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    prompts, rc = prompts_and_config(args, [0, 100, 100, 0, 100, 0], 3, overlap=False)
    cfg, dtype = rc.model, rc.dtype
    with Engine(rc) as eng:
        eng.generate(prompts, 2)
        ours = top_level_calls(lambda: eng.generate(prompts, 3)) - top_level_calls(lambda: eng.generate(prompts, 2))
        model = hf_opt(cfg, dict(eng.weights.handles)).to(dtype)
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        theirs = top_level_calls(lambda: model(nxt, past_key_values=out.past_key_values, use_cache=True))
    for name, calls in (("flexh2o", ours), ("transformers", theirs)):
        print(f"{name}: {sum(calls.values())} aten calls per decode step; most frequent: "
              + ", ".join(f"{k.split('::')[1]} {v}" for k, v in calls.most_common(args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
