"""A run's RunConfig from its EngineArgs (cli/engine_args.py), its model config and its prompts: the device, the tier
capacities, the batch ('auto': the largest that fits), the dtypes (planning/dtype_choice.py) and --policy auto's
search; flexh2o-run, flexh2o-serve and the Python API build theirs here. Imports torch only inside the functions."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Optional

from flexh2o.cli.compress_flags import compression_specs, weight_kernel_mode
from flexh2o.cli.kv_flags import kv_spec

if TYPE_CHECKING:
    from flexh2o.run_config import RunConfig


def build_run_config(args, cfg, prompts, checkpoint=None) -> RunConfig:
    """The RunConfig of `args` (EngineArgs, or flexh2o-serve's parsed flags) for model config `cfg` and `prompts`
    (token-id lists, or None: synthetic ones of --prompt-len), its dtypes chosen and an 'auto' batch the largest
    that fits. checkpoint: args.path's CheckpointReader where the caller has opened it (else opened here, once)."""
    rc, auto = _given_config(args, cfg, prompts, checkpoint)
    choose = getattr(args, "policy", "given") != "auto"  # --policy auto chooses the dtypes with its search
    if choose:
        rc = choose_dtypes(args, rc)
    if auto:  # the largest batch that fits, but no more rows than the prompts of a --prompt-file fill
        cap = -(-len(prompts) // max(rc.num_gpu_batches, 1)) if prompts else None
        rc, best = _auto_batch(rc, cap)
        if choose:  # the dtypes again at the batch that runs (a decode step's best dtype depends on its rows)
            again = choose_dtypes(args, rc)
            if (again.dtype, again.compute, again.decode_compute) != (rc.dtype, rc.compute, rc.decode_compute):
                rc, best = _auto_batch(again, cap)
        why = "largest that fits" if rc.gpu_batch_size == best else f"the prompts' rows; {best} would fit"
        print(f"--gpu-batch-size auto: picked {rc.gpu_batch_size} ({why}, policy {rc.kv.policy})", file=sys.stderr)
    return rc


def _given_config(args, cfg, prompts, checkpoint) -> tuple:
    """(the RunConfig of the flags as given, at batch 1 for 'auto'; whether the batch is 'auto'), each flag's
    refusal in this order."""
    from flexh2o.cli.capacities import capacities
    from flexh2o.placement import Percent
    from flexh2o.run_config import RunConfig, opened_with_kept
    if args.prompt_len < 1 or args.gen_len < 1:
        raise ValueError("--prompt-len and --gen-len must be at least 1")
    if args.max_seqs is not None and (args.max_seqs < 1 or args.policy != "auto"):
        raise ValueError("--max-seqs takes a positive number of sequences, and only with --policy auto")
    prompt_len = max(len(p) for p in prompts) if prompts else args.prompt_len
    kv = kv_spec(args, prompt_len)
    device = _device(args.device)
    gpu_mem, cpu_mem, disk_mem = capacities(args, device)
    nb = args.num_gpu_batches
    given = args.gpu_batch_size or (str(max(1, -(-len(prompts) // max(nb, 1)))) if prompts else "4")
    auto = given == "auto"
    if not auto and not given.isdigit():
        raise ValueError(f"--gpu-batch-size takes a positive integer or 'auto' (got {given})")
    gbs = 1 if auto else int(given)
    packed = compression_specs(args, device)
    checkpoint, weight = opened_with_kept(args.path, checkpoint, packed[0])  # a GGUF's kept blocks stay as they are
    packed = (weight, packed[1])
    rc = RunConfig(model=cfg, percent=Percent.parse(args.percent), gpu_batch_size=gbs, num_gpu_batches=nb,
                   prompt_len=prompt_len, gen_len=args.gen_len, path=args.path, device=device,
                   overlap=args.overlap, cpu_cache_compute=args.cpu_cache_compute, kv=kv, seed=args.seed,
                   gpu_mem=gpu_mem, cpu_mem=cpu_mem, disk_mem=disk_mem, offload_dir=args.offload_dir,
                   compress_weight=packed[0], compress_cache=packed[1], pin_weight=args.pin_weight,
                   weight_kernel=weight_kernel_mode(args), checkpoint=checkpoint)
    return rc, auto


def _device(given: Optional[str]) -> str:
    """--device, or cuda when present, else cpu."""
    import torch
    device = given or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"--device {device}: use cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here; use --device cpu")
    return device


def _auto_batch(rc: RunConfig, cap: Optional[int] = None) -> tuple:
    """(rc at the largest batch that fits, capped at cap rows; that largest batch)."""
    from flexh2o.planning.memory_plan import largest_batch, plan_memory
    best = largest_batch(rc.with_(gpu_batch_size=1))
    if best == 0:
        plan_memory(rc.with_(gpu_batch_size=1)).check()
    return rc.with_(gpu_batch_size=min(best, cap or best)), best


def choose_dtypes(args, rc: RunConfig, fits=None, score=None) -> RunConfig:
    """Storage and compute dtypes from --dtype/--compute-dtype (planning/dtype_choice.py decides); the choice is
    kept on args for the run's report and its note (dtype_note, once every flag is validated)."""
    from flexh2o.planning.dtype_choice import choose_dtypes as choose
    stored = rc.checkpoint.stored_dtype() if rc.checkpoint is not None else None  # --dtype auto keeps it
    args.dtype_choice = choose(rc, args.dtype, args.compute_dtype, fits=fits, score=score, stored=stored)
    return rc.with_(dtype=args.dtype_choice.dtype, compute_dtype=args.dtype_choice.compute,
                    decode_dtype=args.dtype_choice.decode)


def dtype_note(args) -> None:
    """The dtype choice's one-line note (a much faster pair exists), printed once the run is about to start."""
    choice = getattr(args, "dtype_choice", None)
    if choice is not None and choice.note:
        print(f"flexh2o-run: {choice.note}", file=sys.stderr)


def auto_policy(args, rc: RunConfig, hw: Optional[dict], prompts: Optional[list]) -> RunConfig:
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
    rc = choose_dtypes(args, rc, score=score)
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
