"""flexh2o-run: argparse -> RunConfig + Job -> run_job. Every user error becomes one line on stderr and exit 2.
Parsing imports no torch (--help and a flag's error are quick): what needs it is imported where it runs."""
from __future__ import annotations

import argparse
from dataclasses import replace
import os
import sys
from typing import TYPE_CHECKING, Optional

from flexh2o import config as model_configs
from flexh2o.cli.checks import check_output_path, check_run_flags
from flexh2o.cli.console import Parser, run_main
from flexh2o.errors import one_line
from flexh2o.cli.help_text import model_help
from flexh2o.cli.compress_flags import add_compression_flags, compression_specs, weight_kernel_mode
from flexh2o.cli.flexgen_flags import add_flexgen_flags, flexgen_options, str2bool
from flexh2o.requests import check_sampling
from flexh2o.cli.kv_flags import add_kv_flags, budget_warning, kv_spec
from flexh2o.cli.request_job import (add_request_flags, is_request_job, load_request_file, reads_requests,
                                     rounds_line, run_request_job)

if TYPE_CHECKING:
    from flexh2o.run_config import RunConfig


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flexh2o-run", description="High-throughput offloaded generation with H2O KV eviction.")
    a = p.add_argument
    a("--model", default=None, help=model_help("opt-125m", "or a local Hugging Face folder or .gguf file "
      "(converted once into ~/.cache/flexh2o/models; nothing is downloaded) or a converted checkpoint; not with "
      "--path"))
    a("--path", default="_DUMMY_", help="converted checkpoint dir (flexh2o-convert), a Hugging Face folder or .gguf "
      "file (converted once, as --model), or _DUMMY_ for seeded weights")
    a("--percent", nargs="+", default=["100", "0", "100", "0", "100", "0"],
      help="weights-gpu weights-cpu cache-gpu cache-cpu [act-gpu act-cpu], in %%; disk gets the rest of each pair")
    a("--gpu-batch-size", default=None, help="sequences per GPU batch, or 'auto' (largest that fits); default: "
      "the prompts of --prompt-file over --num-gpu-batches, else 4")
    a("--num-gpu-batches", type=int, default=1, help="GPU batches that share each weight load in the block schedule "
      "(FlexGen's); sequences in flight = --gpu-batch-size x this")
    a("--prompt-len", type=int, default=512, help="tokens per synthetic prompt (with --prompt-file: the longest "
      "prompt's length)")
    a("--gen-len", type=int, default=32, help="tokens generated per sequence")
    a("--prompt-file", help=".json list of token-id lists, or text (one prompt per line) with --tokenizer")
    a("--tokenizer", help="local tokenizer file or folder (never downloaded; default: the --model .gguf, or its "
                          "folder's tokenizer.json)")
    a("--output-file", help="write generated tokens (and text) as JSON")
    a("--log-file", help="append one JSON record of this run")
    a("--dtype", default="auto", help="storage dtype of weights and cache, or auto (a checkpoint's own dtype, "
      "never narrower unasked; seeded weights: the compute dtype when all is in memory and fits, else 16 bits; see "
      "flexh2o/planning/dtype_choice.py)")
    a("--compute-dtype", default="auto", help="auto: on CUDA the storage dtype where fast, on CPU the fastest in a "
      "cached probe of this machine")
    a("--device", default=None, help="cuda or cpu (default: cuda when present)")
    a("--overlap", type=str2bool, nargs="?", const=True, default=True, help="overlap I/O with compute (true/false)")
    a("--cpu-cache-compute", action="store_true", help="decode attention next to a cpu-tier cache")
    a("--gpu-mem", help="gpu tier capacity (e.g. 16GB); default: detected")
    a("--cpu-mem", help="cpu tier capacity; default: detected")
    a("--disk-mem", help="disk tier capacity; default: free space of --offload-dir")
    a("--offload-dir", default=os.path.join(os.path.expanduser("~"), "flexh2o_offload"), help="where the disk tier's "
      "files go (in a per-run directory, removed at exit)")
    add_kv_flags(p)
    a("--hh-all", type=str2bool, nargs="?", const=True, default=None, help="the H2O port's eviction at every "
      "decode step: what flexh2o's h2o always does (false is refused)")
    a("--temperature", type=float, default=0.0, help="0 = greedy")
    a("--top-p", type=float, default=1.0, help="with --temperature > 0: sample from the smallest set of tokens whose "
      "probability reaches this, in (0, 1]; 1 = all")
    a("--seed", type=int, default=0, help="seed of the dummy weights, synthetic prompts, sampling and the random "
      "policy")
    a("--policy", choices=["given", "auto"], default="given",
      help="given: the placement and batch of the flags; auto: search --percent and batch sizes for the best "
      "predicted throughput (cost model)")
    a("--max-seqs", type=int, help="--policy auto: run at most this many sequences at once (gpu batch x GPU "
      "batches; default: the prompts of --prompt-file, else no limit)")
    a("--hardware", default="auto", help="hardware profile for predictions, --dry-run and --policy auto: auto (this "
      "machine's, cached; measured once, under a minute, the first time --dry-run or --policy auto needs it), a "
      "shipped name (t4_paper, a100_80gb) or a flexh2o-profile JSON file")
    add_compression_flags(p)
    a("--dry-run", action="store_true", help="print the memory plan (and predicted figures) and exit")
    a("--no-warmup", action="store_true", help="skip the untimed warm-up run (timings then include one-time costs)")
    add_request_flags(p)
    add_flexgen_flags(p)
    a("--stage-layers", help="under torchrun: decoder layers per stage, one count per rank (e.g. 12,12); default: "
      "split by weight bytes")
    a("--stage-timeout", type=float, default=300.0, help="under torchrun: seconds a stage waits for a peer before "
      "the job stops")
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
    args = build_parser().parse_args(argv)
    check_run_flags(args)
    warning = budget_warning(args.kv_budget)  # obeyed as given, once said
    if warning:
        print(f"flexh2o-run: {warning}", file=sys.stderr)
    if not reads_requests(args):  # every row at --temperature: refused before any work
        check_sampling(args.top_p, args.top_k, [args.temperature])
    return args


def _run(args) -> int:
    from flexh2o.prompts import load_prompts, load_tokenizer, synthetic_prompts
    from flexh2o.sampling import Sampler
    from flexh2o.storage.offload_dir import sweep
    from flexh2o.cli.model_source import converted_config, resolve_source
    from flexh2o.cli.plan_text import describe_plan, describe_stage_plan
    from flexh2o.cli.prediction import hardware_profile, predict_run
    from flexh2o.pipeline.group import launched_by_torchrun
    from flexh2o.pipeline.split import parse_stage_layers, split_stages

    opts = flexgen_options(args)  # FlexGen's flags: refused, or their meaning for this run
    sweep(args.offload_dir)  # stale run dirs of killed runs go first, before free space is measured
    resolve_source(args, "flexh2o-run")  # a Hugging Face folder or .gguf: its cached conversion
    cfg = converted_config(args.path) if args.path != "_DUMMY_" else model_configs.from_name(args.model or "opt-125m")
    tokenizer = load_tokenizer(args.tokenizer)
    reqs = load_request_file(args, cfg, tokenizer)  # a .jsonl --prompt-file (cli/request_job.py)
    if reqs is not None:  # a request's own temperature may read --top-p
        check_sampling(args.top_p, args.top_k, [r.temperature for r in reqs])
    prompts = ([list(r.prompt_ids) for r in reqs] if reqs is not None
               else load_prompts(args.prompt_file, cfg.vocab, tokenizer) if args.prompt_file else None)
    rc = build_run_config(args, cfg, prompts)
    if args.dry_run and launched_by_torchrun():  # each rank: its own stage's plan (no cost-model prediction)
        _note(args)
        print(describe_stage_plan(rc, args.stage_layers), flush=True)
        return 0
    hw, hw_label = hardware_profile(args, rc)
    if args.policy == "auto":
        rc = _auto_policy(args, rc, hw, prompts)
    predicted = predict_run(rc, hw, quiet=not args.dry_run)
    from flexh2o.tuning.refusal import check_fits
    if args.dry_run:
        _note(args)
        print(describe_plan(rc), flush=True)
        check_fits(rc, hw)  # a plan that does not fit: the run's own refusal (exit 2), and no prediction
        if predicted:
            print(f"predicted (cost model, profile {hw_label}): prefill "
                  f"{predicted['prefill_s']:.2f} s, decode {predicted['decode_s']:.2f} s, total "
                  f"{predicted['total_throughput']:.1f} tok/s, decode {predicted['decode_throughput']:.1f} tok/s")
        return 0
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
    _note(args)
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


def build_run_config(args, cfg, prompts) -> RunConfig:
    import torch
    from flexh2o.cli.capacities import capacities
    from flexh2o.placement import Percent
    from flexh2o.run_config import RunConfig
    from flexh2o.weights.kept_run import with_checkpoint
    if args.prompt_len < 1 or args.gen_len < 1:
        raise ValueError("--prompt-len and --gen-len must be at least 1")
    if args.max_seqs is not None and (args.max_seqs < 1 or args.policy != "auto"):
        raise ValueError("--max-seqs takes a positive number of sequences, and only with --policy auto")
    prompt_len = max(len(p) for p in prompts) if prompts else args.prompt_len
    kv = kv_spec(args, prompt_len)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"--device {device}: use cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here; use --device cpu")
    gpu_mem, cpu_mem, disk_mem = capacities(args, device)
    nb = args.num_gpu_batches
    given = args.gpu_batch_size or (str(max(1, -(-len(prompts) // max(nb, 1)))) if prompts else "4")
    auto = given == "auto"
    if not auto and not given.isdigit():
        raise ValueError(f"--gpu-batch-size takes a positive integer or 'auto' (got {given})")
    gbs = 1 if auto else int(given)
    packed = compression_specs(args, device)
    packed = (with_checkpoint(packed[0], args.path), packed[1])  # a converted GGUF's kept blocks stay as they are
    rc = RunConfig(model=cfg, percent=Percent.parse(args.percent), gpu_batch_size=gbs, num_gpu_batches=nb,
                   prompt_len=prompt_len, gen_len=args.gen_len, path=args.path, device=device,
                   overlap=args.overlap, cpu_cache_compute=args.cpu_cache_compute, kv=kv, seed=args.seed,
                   gpu_mem=gpu_mem, cpu_mem=cpu_mem, disk_mem=disk_mem, offload_dir=args.offload_dir,
                   compress_weight=packed[0], compress_cache=packed[1], pin_weight=args.pin_weight,
                   weight_kernel=weight_kernel_mode(args))
    choose = getattr(args, "policy", "given") != "auto"  # --policy auto chooses the dtypes with its search
    if choose:
        rc = _choose_dtypes(args, rc)
    if auto:  # the largest batch that fits, but no more rows than the prompts of a --prompt-file fill
        cap = -(-len(prompts) // max(nb, 1)) if prompts else None
        rc, best = _auto_batch(rc, cap)
        if choose:  # the dtypes again at the batch that runs (a decode step's best dtype depends on its rows)
            again = _choose_dtypes(args, rc)
            if (again.dtype, again.compute, again.decode_compute) != (rc.dtype, rc.compute, rc.decode_compute):
                rc, best = _auto_batch(again, cap)
        why = "largest that fits" if rc.gpu_batch_size == best else f"the prompts' rows; {best} would fit"
        print(f"--gpu-batch-size auto: picked {rc.gpu_batch_size} ({why}, policy {kv.policy})", file=sys.stderr)
    return rc


def _auto_batch(rc: RunConfig, cap: Optional[int] = None) -> tuple:
    """(rc at the largest batch that fits, capped at cap rows; that largest batch)."""
    from flexh2o.planning.memory_plan import largest_batch, plan_memory
    best = largest_batch(rc.with_(gpu_batch_size=1))
    if best == 0:
        plan_memory(rc.with_(gpu_batch_size=1)).check()
    return rc.with_(gpu_batch_size=min(best, cap or best)), best


def _choose_dtypes(args, rc: RunConfig, fits=None, score=None) -> RunConfig:
    """Storage and compute dtypes from --dtype/--compute-dtype (planning/dtype_choice.py decides); the choice is
    kept on args for the run's report and its note (_note, once every flag is validated)."""
    from flexh2o.planning.dtype_choice import choose_dtypes
    from flexh2o.weights.index import checkpoint_dtype
    stored = checkpoint_dtype(rc.path) if rc.path != "_DUMMY_" else None  # --dtype auto keeps it
    args.dtype_choice = choose_dtypes(rc, args.dtype, args.compute_dtype, fits=fits, score=score, stored=stored)
    return rc.with_(dtype=args.dtype_choice.dtype, compute_dtype=args.dtype_choice.compute,
                    decode_dtype=args.dtype_choice.decode)


def _note(args) -> None:
    """The dtype choice's one-line note (a much faster pair exists), printed once the run is about to start."""
    choice = getattr(args, "dtype_choice", None)
    if choice is not None and choice.note:
        print(f"flexh2o-run: {choice.note}", file=sys.stderr)


def _auto_policy(args, rc: RunConfig, hw: Optional[dict], prompts: Optional[list]) -> RunConfig:
    """The searched placement and batch; the dtypes are the option whose searched best plan is predicted fastest."""
    from flexh2o.planning.memory_plan import plan_memory
    from flexh2o.tuning.search import command_line, search
    if hw is None:
        raise ValueError("--policy auto needs a hardware profile: pass --hardware FILE (see flexh2o-profile)")
    tried = {}
    cap = args.max_seqs or (len(prompts) if prompts else None)

    def score(r: RunConfig) -> Optional[float]:  # seconds a generated token of r's best plan; None: none fits
        try:
            tried[r] = search(r, hw, max_seqs=cap)
        except ValueError:  # the profile has no rates for this compute dtype
            return None
        return 1.0 / tried[r][0][1].total_throughput if tried[r] else None
    rc = _choose_dtypes(args, rc, score=score)
    found = tried[rc] if rc in tried else search(rc, hw, max_seqs=cap)
    if not found:
        from flexh2o.tuning.least import least_message
        least = least_message(rc)  # what the least placement needs, not the default placement's need
        if least:
            raise ValueError(f"--policy auto: {least}")
        plan_memory(rc).check()
        raise ValueError("--policy auto found no placement that fits: raise --gpu-mem/--cpu-mem/--disk-mem")
    best, pred = found[0]
    print(f"--policy auto: {command_line(best)}  (predicted {pred.total_throughput:.1f} tok/s)", file=sys.stderr)
    return best


if __name__ == "__main__":
    sys.exit(main())
