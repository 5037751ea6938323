"""FlexGen's flex_opt flags and the H2O port's that flexh2o-run has no native flag for: each is accepted with
FlexGen's meaning or refused in one line saying why and what to use instead (see the README's table)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional

from flexh2o.cli.flags import add_flags, declare

FEWER_BATCH_STEPS = 5  # steps of a --debug-mode fewer_batch run when --cut-gen-len is not given


def str2bool(text: str) -> bool:
    """FlexGen's boolean flags: yes/no, true/false, t/f, y/n, 1/0 (any case)."""
    low = text.lower()
    if low in ("yes", "true", "t", "y", "1"):
        return True
    if low in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {text!r}")


def flexgen_flags() -> tuple:
    """FlexGen's flags and the H2O port's (each accepted with its meaning, or refused: flexgen_options)."""
    flags: list = []
    a = declare(flags)
    a("--cut-gen-len", type=int, help="run only this many generation steps and project the decode time to "
      "--gen-len (FlexGen's shortened runs; the report marks the figures projected)")
    a("--debug-mode", choices=["fewer_batch", "breakdown"], help=f"fewer_batch: a shortened run (--cut-gen-len, "
      f"default {FEWER_BATCH_STEPS} steps), figures projected; breakdown: refused (see the README)")
    a("--sep-layer", type=str2bool, nargs="?", const=True, default=None, help="FlexGen's attention/MLP split: "
      "only false (flexh2o schedules whole decoder layers)")
    a("--pin-weight", type=str2bool, nargs="?", const=True, default=True, help="pin the cpu tier's memory "
      "(CUDA only; default true)")
    a("--attn-sparsity", type=float, default=1.0, help="FlexGen's top-k sparse decode attention: only 1.0")
    a("--no-log", action="store_true", help="write no --log-file")
    a("--verbose", type=int, default=2, help="0: no summary on stdout; 1 or more: the summary (FlexGen's default 2)")
    a("--hh-long-seq", type=str2bool, nargs="?", const=True, default=False, help="the H2O port's long-sequence "
      "mode: refused (see the README)")
    return tuple(flags)


def add_flexgen_flags(p: argparse.ArgumentParser) -> None:
    """flexgen_flags() added to parser `p`."""
    add_flags(p, flexgen_flags())


@dataclass(frozen=True)
class FlexGenOptions:
    """What the FlexGen flags mean for one run."""

    measured_steps: Optional[int] = None  # generation steps actually run (None: --gen-len)
    pin_weight: bool = True
    log_file: Optional[str] = None
    verbose: int = 2


def flexgen_options(args: argparse.Namespace) -> FlexGenOptions:
    """Refuse what flexh2o does not do (ValueError, one line), turn the rest into options."""
    _refuse_unsupported(args)
    steps = args.cut_gen_len
    if steps is None and args.debug_mode == "fewer_batch":
        steps = FEWER_BATCH_STEPS
    if steps is not None:
        if steps < 2:
            raise ValueError(f"--cut-gen-len {steps}: use at least 2 (the prefill step and one decode step to "
                             "project from)")
        steps = None if steps >= args.gen_len else steps
    log = None if args.no_log else args.log_file
    if log == "auto":
        log = auto_log_name(args)
    return FlexGenOptions(steps, args.pin_weight, log, args.verbose)


def _refuse_unsupported(args: argparse.Namespace) -> None:
    if args.debug_mode == "breakdown":
        raise ValueError("--debug-mode breakdown (FlexGen's per-operation time breakdown) is not implemented: use "
                         "--dry-run for the cost model's per-resource terms, or --overlap false for serial timings")
    if args.sep_layer:
        raise ValueError("--sep-layer true (attention and MLP as separate schedule layers) is not implemented: "
                         "flexh2o runs FlexGen's --sep-layer false; drop the flag")
    if args.attn_sparsity != 1.0:
        raise ValueError(f"--attn-sparsity {args.attn_sparsity} (FlexGen's top-k sparse decode attention) is not "
                         "implemented: bound attention with a KV budget instead (--hh-ratio R or --kv-budget N)")
    if args.hh_long_seq:
        raise ValueError("--hh-long-seq (the H2O port's OPT run without position embeddings) is not supported: "
                         "keep prompt + generation within the model's positions, or use a Llama-family model")
    if args.hh_all is False:
        raise ValueError("--hh-all false (the H2O port's prefill-only pruning) is not implemented: flexh2o's h2o "
                         "evicts at every decode step, the port's --hh-all true; drop the flag")


def auto_log_name(args: argparse.Namespace) -> str:
    """FlexGen's --log-file auto: a name made of the model size, batch, lengths, --percent and options."""
    size = (args.model or "opt-125m").split("-")[-1]
    name = (f"fo-{size}-gbs{args.gpu_batch_size or 'default'}-ngbs{args.num_gpu_batches}-prompt{args.prompt_len}-"
            f"gen{args.gen_len}-percent-{'-'.join(map(str, args.percent))}-"
            f"{'cpu' if args.cpu_cache_compute else 'gpu'}-cache")
    name += "-compw" * bool(args.compress_weight) + "-compc" * bool(args.compress_cache)
    return os.path.abspath(name + ".log")
