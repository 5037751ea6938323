"""A memory-resident decode step, flexh2o against transformers on the same weights, alternated in one process.

    python benchmarks/decode_step.py --model opt-125m --batch 8 --prompt-len 128 --gen-len 12 --rounds 2

flexh2o: Engine.generate with every weight, cache block and activation in the gpu tier (--dtype, default fp32,
KV policy full),
decode seconds per step from its own timings; transformers: OPTForCausalLM (tests/conftest.hf_opt) over the same
weights with its KV cache, greedy, the prefill outside the timing. Rounds alternate the two; prints each round's
ms per step and the median ratio. Timed in-process: on a shared machine quote the ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from conftest import hf_opt  # noqa: E402
from flexh2o.engine import Engine  # noqa: E402
from resident import add_flags, prompts_and_config  # noqa: E402


def hf_decode(model, prompts: list, gen_len: int) -> float:
    """Seconds per decode step of transformers' cached forward, greedy."""
    with torch.inference_mode():
        out = model(torch.tensor(prompts), use_cache=True)
        nxt, cache = out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values
        start = time.perf_counter()
        for _ in range(gen_len - 1):
            out = model(nxt, past_key_values=cache, use_cache=True)
            nxt, cache = out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values
        return (time.perf_counter() - start) / (gen_len - 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flags(ap, prompt_len=128)
    ap.add_argument("--gen-len", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    prompts, rc = prompts_and_config(args, [100, 0, 100, 0, 100, 0], args.gen_len)
    cfg, dtype = rc.model, rc.dtype
    ours, theirs = [], []
    with Engine(rc) as eng:
        model = hf_opt(cfg, dict(eng.weights.handles)).to(dtype)
        eng.generate(prompts, 2)  # warm-up
        for r in range(args.rounds):
            g = eng.generate(prompts, args.gen_len)
            ours.append(g.decode_s / (args.gen_len - 1))
            theirs.append(hf_decode(model, prompts, args.gen_len))
            print(f"round {r}: flexh2o {ours[-1] * 1e3:.1f} ms/step, transformers {theirs[-1] * 1e3:.1f} ms/step")
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"median: flexh2o {a * 1e3:.1f}, transformers {b * 1e3:.1f} ms/step: flexh2o decode {b / a:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
