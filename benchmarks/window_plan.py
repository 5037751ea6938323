"""--dry-run's largest batch for models with sliding windows, with and without the window.

For each case, flexh2o-run's own parser and RunConfig (cli/run.py) build the run of
`flexh2o-run --model M --percent 0 100 100 0 --gpu-mem 16GB --cpu-mem 200GB --dtype float16 --prompt-len P
--gen-len G [--hh-ratio R] --dry-run`; the largest batch is the one search --dry-run prints
(planning/memory_plan.largest_batch), once for the model as it is (windowed layers hold min(window, budget + 1,
context) slots) and once for the same model with `sliding_window` removed (every layer holds the policy's slots).
A plan, not a timing: the figures are the same on any machine.

    python benchmarks/window_plan.py
"""
from __future__ import annotations

import sys
from dataclasses import replace

from flexh2o.cli.plan_text import _slots_text
from flexh2o.cli.run import _parse, build_run_config
from flexh2o.config import from_name
from flexh2o.planning.memory_plan import largest_batch, plan_memory
from flexh2o.units import fmt_bytes

MACHINE = ["--percent", "0", "100", "100", "0", "--gpu-mem", "16GB", "--cpu-mem", "200GB", "--dtype", "float16"]
CASES = [("mistral-7b", 8192, 256, None), ("mistral-7b", 16384, 256, None), ("mistral-7b", 16384, 256, 0.2),
         ("gemma-2-9b", 8000, 192, None), ("gemma-2-9b", 8000, 192, 0.2)]


def case_row(model: str, prompt: int, gen: int, ratio) -> str:
    argv = ["--model", model, *MACHINE, "--prompt-len", str(prompt), "--gen-len", str(gen), "--dry-run"]
    argv += ["--hh-ratio", str(ratio)] if ratio is not None else []
    cfg = from_name(model)
    rc = build_run_config(_parse(argv), cfg, None)
    plain = rc.with_(model=replace(cfg, sliding_window=None, layer_kinds=""))
    n, m = largest_batch(rc), largest_batch(plain)
    cache = [plan_memory(r.with_(gpu_batch_size=1)).bytes["gpu"]["cache"] for r in (rc, plain)]
    return (f"| {model} | {prompt}+{gen} | {rc.kv.describe()} | {_slots_text(rc)} | {fmt_bytes(cache[0])} / "
            f"{fmt_bytes(cache[1])} | **{n}** / {m} | {n / m:.2f}x |")


def main() -> int:
    print("| model | prompt+gen | kv policy | cache slots (windowed) | cache per sequence: window / none | "
          "largest batch: window / none | ratio |")
    print("|---|---|---|---|---|---|---|")
    for case in CASES:
        print(case_row(*case), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
