"""flexh2o-run: flags (generated from EngineArgs, cli/engine_args.py) -> RunConfig (cli/configure.py) + Job ->
run_job. Every user error becomes one line on stderr and exit 2. Parsing imports no torch (--help and a flag's error
are quick): what needs it is imported where it runs."""
from __future__ import annotations

import argparse
from dataclasses import replace
import os
import sys
from typing import TYPE_CHECKING, Optional

from flexh2o import config as model_configs
from flexh2o.cli.checks import check_output_path, check_run_flags
from flexh2o.cli.configure import auto_policy, build_run_config, dtype_note
from flexh2o.cli.console import Parser, run_main
from flexh2o.cli.engine_args import EngineArgs, run_flags
from flexh2o.cli.flags import add_flags
from flexh2o.cli.flexgen_flags import flexgen_options
from flexh2o.cli.kv_flags import budget_warning
from flexh2o.cli.request_job import is_request_job, load_request_file, reads_requests, rounds_line, run_request_job
from flexh2o.errors import one_line
from flexh2o.requests import check_sampling

if TYPE_CHECKING:
    from flexh2o.run_config import RunConfig


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flexh2o-run", description="High-throughput offloaded generation with H2O KV eviction.")
    add_flags(p, run_flags())  # one option per field (and per KV policy parameter registered now)
    return p


def main(argv: Optional[list] = None) -> int:
    return run_main("flexh2o-run", lambda: _body(argv), "interrupted; offload files removed")


class Refusal(ValueError):
    """The plan does not fit (check_fits), found before anything is built: no tier, file or thread exists yet."""


def _body(argv: Optional[list]) -> int:
    """The run; from the console script (argv None) a Refusal is printed as run_main prints an error and the process
    exits 2 at once: nothing is left to clean, and the interpreter's teardown of torch took ~0.3 s of a 2 s refusal."""
    try:
        return _run(_parse(argv))
    except Refusal as e:
        if argv is not None:
            raise
        print(f"flexh2o-run: error: {one_line(e)}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)


def _parse(argv: Optional[list]):
    args = EngineArgs.from_namespace(build_parser().parse_args(argv))
    check_run_flags(args)
    warning = budget_warning(args.kv_budget)  # obeyed as given, once said
    if warning:
        print(f"flexh2o-run: {warning}", file=sys.stderr)
    if not reads_requests(args):  # every row at --temperature: refused before any work
        check_sampling(args.top_p, args.top_k, [args.temperature])
    return args


def _inputs(args) -> tuple:
    """(model config, tokenizer, requests of a .jsonl --prompt-file or None, prompts or None, the opened checkpoint
    or None): the model source resolved (a Hugging Face folder or .gguf: its cached conversion), the prompts read
    and checked."""
    from flexh2o.cli.model_source import open_checkpoint, resolve_source
    from flexh2o.prompts import load_prompts, load_tokenizer
    resolve_source(args, "flexh2o-run")
    checkpoint = open_checkpoint(args.path) if args.path != "_DUMMY_" else None
    cfg = checkpoint.config if checkpoint else model_configs.from_name(args.model or "opt-125m")
    tokenizer = load_tokenizer(args.tokenizer)
    reqs = load_request_file(args, cfg, tokenizer)  # a .jsonl --prompt-file (cli/request_job.py)
    if reqs is not None:  # a request's own temperature may read --top-p
        check_sampling(args.top_p, args.top_k, [r.temperature for r in reqs])
    prompts = ([list(r.prompt_ids) for r in reqs] if reqs is not None
               else load_prompts(args.prompt_file, cfg.vocab, tokenizer) if args.prompt_file else None)
    return cfg, tokenizer, reqs, prompts, checkpoint


def _dry_run(args, rc: RunConfig, hw, hw_label, predicted) -> int:
    """--dry-run: the plan, its refusal if it does not fit, and the predicted figures."""
    from flexh2o.cli.plan_text import describe_plan
    from flexh2o.tuning.refusal import check_fits
    dtype_note(args)
    print(describe_plan(rc), flush=True)
    check_fits(rc, hw)  # a plan that does not fit: the run's own refusal (exit 2), and no prediction
    if predicted:
        print(f"predicted (cost model, profile {hw_label}): prefill "
              f"{predicted['prefill_s']:.2f} s, decode {predicted['decode_s']:.2f} s, total "
              f"{predicted['total_throughput']:.1f} tok/s, decode {predicted['decode_throughput']:.1f} tok/s")
    return 0


def _run(args) -> int:
    from flexh2o.prompts import synthetic_prompts
    from flexh2o.sampling import Sampler
    from flexh2o.storage.offload_dir import sweep
    from flexh2o.cli.plan_text import describe_stage_plan
    from flexh2o.cli.prediction import hardware_profile, predict_run
    from flexh2o.pipeline.group import launched_by_torchrun
    from flexh2o.pipeline.split import parse_stage_layers, split_stages

    opts = flexgen_options(args)  # FlexGen's flags: refused, or their meaning for this run
    sweep(args.offload_dir)  # stale run dirs of killed runs go first, before free space is measured
    cfg, tokenizer, reqs, prompts, checkpoint = _inputs(args)
    rc = build_run_config(args, cfg, prompts, checkpoint)
    if args.dry_run and launched_by_torchrun():  # each rank: its own stage's plan (no cost-model prediction)
        dtype_note(args)
        print(describe_stage_plan(rc, args.stage_layers), flush=True)
        return 0
    hw, hw_label = hardware_profile(args, rc)
    if args.policy == "auto":
        rc = auto_policy(args, rc, hw, prompts)
    predicted = predict_run(rc, hw, quiet=not args.dry_run)
    if args.dry_run:
        return _dry_run(args, rc, hw, hw_label, predicted)
    from flexh2o.tuning.refusal import check_fits
    check_output_path(opts.log_file, "--log-file")
    if not launched_by_torchrun():  # under torchrun each stage plans its own layers (pipeline/job.py)
        # before anything is built from the sizes (the prompts included); a refusal's search shows a bar on a tty
        try:
            check_fits(rc, hw, progress=opts.verbose > 0 and sys.stderr.isatty())
        except ValueError as e:
            raise Refusal(str(e)) from None
    if prompts is not None and len(prompts) > rc.num_seqs and not is_request_job(args):  # job.py: in rounds
        print(f"flexh2o-run: {rounds_line(len(prompts), rc.num_seqs, 'prompts')}", file=sys.stderr)
    if prompts is None:
        prompts = synthetic_prompts(rc.num_seqs, rc.prompt_len, cfg.vocab, rc.seed)
    if is_request_job(args):
        return run_request_job(args, rc, cfg, reqs, prompts, tokenizer, opts)
    from flexh2o.job import Job, run_job  # the engine: after every refusal
    job = Job(prompts, Sampler(args.temperature, args.top_p, args.seed, args.top_k), args.output_file,
              opts.log_file, tokenizer, warmup=not args.no_warmup, progress=sys.stderr.isatty(),
              predicted=predicted, dtype_reason=args.dtype_choice.reason, measured_steps=opts.measured_steps)
    dtype_note(args)
    if launched_by_torchrun():
        return _run_stages(args, rc, job)
    if args.stage_layers:
        split_stages(cfg, 1, parse_stage_layers(args.stage_layers))  # one process: only "all layers" is valid
    report = run_job(rc, job)
    if opts.verbose >= 1:
        print(report.summary())
    return 0


def _run_stages(args, rc: RunConfig, job) -> int:
    """This rank's stage of a job torchrun launched; the summary comes from the rank holding the head."""
    from flexh2o.pipeline.job import Refusal, refusal_exit, run_stages
    if args.stage_timeout <= 0:
        raise ValueError(f"--stage-timeout {args.stage_timeout}: give a positive number of seconds")
    if job.measured_steps:
        raise ValueError("--cut-gen-len and --debug-mode fewer_batch shorten a one-process run: drop them under "
                         "torchrun")
    try:
        report = run_stages(rc, replace(job, predicted=None), args.stage_layers, args.stage_timeout)
    except Refusal as e:
        code = refusal_exit(e)
        sys.stdout.flush()
        sys.stderr.flush()
        # skip interpreter teardown: once torchrun has stopped a peer, c10d/gloo destructors can abort (SIGABRT,
        # exit -6 instead of 2); nothing is left to clean, the refusal comes before anything is allocated
        os._exit(code)
    if report is not None:
        print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
