"""Command-line values checked before anything is built from them: each bad value or bad combination is one
ValueError naming the flag and the fix (console.run_main turns it into one line and exit status 2)."""
from __future__ import annotations

import math
import os
from typing import Optional

MAX_NUM_GPU_BATCHES = 1 << 12  # the plan and the schedule enumerate layers x GPU batches; FlexGen uses <= 64
MAX_SEED = (1 << 63) - 1  # torch.Generator.manual_seed takes a 64-bit value


def check_real(flag: str, value: Optional[float], lo: float, hi: float = math.inf, lo_open: bool = False,
               fix: str = "") -> None:
    """value is None (not given) or a finite number in [lo, hi] ((lo, hi] when lo_open)."""
    if value is None:
        return
    ok = math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if math.isfinite(hi) else f"{'>' if lo_open else '>='} {lo:g}"
        raise ValueError(f"{flag} {value}: must be a finite number {'in ' if math.isfinite(hi) else ''}{rng}"
                         + (f"; {fix}" if fix else ""))


def check_int(flag: str, value: Optional[int], lo: int, hi: Optional[int] = None, fix: str = "") -> None:
    if value is None:
        return
    if value < lo or (hi is not None and value > hi):
        bound = f"at least {lo}" if hi is None else f"{lo}..{hi}"
        raise ValueError(f"{flag} {value}: must be {bound}" + (f"; {fix}" if fix else ""))


def check_kv_flags(args, policy: Optional[str]) -> None:
    """--hh-ratio/--recent-ratio/--kv-budget/--num-sinks: ranges, and the combinations that would silently drop one.
    policy: --kv-policy as given (None: chosen from the other flags)."""
    fix = "a ratio is the share of the prompt kept, e.g. 0.2"
    hh, recent, kv_budget = (getattr(args, f, None) for f in ("hh_ratio", "recent_ratio", "kv_budget"))
    check_real("--hh-ratio", hh, 0.0, 1.0, fix=fix)
    check_real("--recent-ratio", recent, 0.0, 1.0, fix=fix)
    check_policy_params(args)
    if hh is not None and kv_budget is not None:
        raise ValueError("--hh-ratio and --kv-budget both set the KV budget: give one of them")
    if recent is not None and hh is None:
        raise ValueError("--recent-ratio sets the recent window beside --hh-ratio: give --hh-ratio too "
                         "(or --kv-budget alone)")
    if policy == "full" and (recent is not None or hh is not None or kv_budget is not None):
        raise ValueError("--kv-policy full keeps every token: drop --hh-ratio/--recent-ratio/--kv-budget or pick "
                         "another policy")
    if policy is not None or hasattr(args, "kv_policy"):  # flexh2o-eval checks its --policies once parsed
        from flexh2o.kv.spec import chosen_policy
        check_params_read(args, [chosen_policy(policy, hh is not None or kv_budget is not None)])


def check_params_read(args, policies) -> None:
    """A policy parameter's flag given a value other than its default must be read by one of `policies` (names,
    WRAPPER:POLICY included), else it would be ignored without a word: which policies read it is what the printed
    command line shows (Param.printed)."""
    from flexh2o.kv.policies import POLICIES, policy_class, policy_params
    classes = [policy_class(name) for name in policies]
    for p in policy_params():
        value = getattr(args, p.name, None)
        if value is None or value == p.default or any(p.printed(cls, value) for cls in classes):
            continue
        readers = ", ".join(name for name, cls in sorted(POLICIES.items()) if p.printed(cls, value))
        which = f"the {policies[0]} policy does not read it" if len(policies) == 1 else \
            f"none of the policies {', '.join(policies)} reads it"
        raise ValueError(f"{p.flag} {value}: {which} (read by {readers}): drop it or pick one of those")


def check_policy_params(args) -> None:
    """Every policy parameter's flag (kv/policies/params.py declares them): in range, worded as here when the
    parameter gives a `fix`, else as the KVSpec words it."""
    from flexh2o.kv.policies import policy_params
    for p in policy_params():
        value = getattr(args, p.name, None)
        if value is None:
            continue
        if p.fix is None:
            p.check(value)
        elif p.type is int:
            check_int(p.flag, value, int(p.lo), None if math.isinf(p.hi) else int(p.hi), fix=p.fix)
        else:
            check_real(p.flag, value, p.lo, p.hi, fix=p.fix)


def check_run_flags(args) -> None:
    """Every flexh2o-run value that is not checked where it is parsed, before any config, prompt or tier exists."""
    if args.path != "_DUMMY_" and args.model is not None:
        raise ValueError("--model and --path both name the model: --path uses the config stored with the converted "
                         "checkpoint, so drop --model")
    check_kv_flags(args, args.kv_policy)
    check_int("--prompt-len", args.prompt_len, 1)
    check_int("--gen-len", args.gen_len, 1)
    check_int("--num-gpu-batches", args.num_gpu_batches, 1, MAX_NUM_GPU_BATCHES,
              fix="raise --gpu-batch-size instead")
    check_int("--seed", args.seed, 0, MAX_SEED)
    check_real("--temperature", args.temperature, 0.0, fix="0 is greedy decoding")
    check_real("--top-p", args.top_p, 0.0, 1.0, lo_open=True)
    check_int("--top-k", args.top_k, 0, fix="0 samples from every token")
    for flag in ("--gpu-mem", "--cpu-mem", "--disk-mem"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not value.strip():
            raise ValueError(f"{flag} is empty: give a size such as 16GB, or leave the flag out for the default")
    check_output_path(args.output_file, "--output-file")
    check_output_path(args.log_file, "--log-file")
    check_named_values(args)


def check_named_values(args) -> None:
    """Values that must name something: an empty --gpu-batch-size or --model is refused (argparse keeps ''), and
    --offload-dir must not be under /proc or /sys (kernel file systems: no files can be made there)."""
    for flag, value in (("--gpu-batch-size", args.gpu_batch_size), ("--model", args.model)):
        if value is not None and not value.strip():
            raise ValueError(f"{flag} is empty: give a value, or leave the flag out for the default")
    off = getattr(args, "offload_dir", None)
    if off:
        real = os.path.realpath(off)
        for kernel_fs in ("/proc", "/sys"):
            if real == kernel_fs or real.startswith(kernel_fs + "/"):
                raise ValueError(f"--offload-dir {off} is under {kernel_fs}, a kernel file system that holds no "
                                 "files: pass a directory on a disk")


def check_host_capacity(device: str, gpu_mem: int, cpu_mem: int, ranks: int = 1) -> None:
    """Host memory a plan may count on cannot exceed the machine's (RAM + swap): past that, the plan's refusal
    would be replaced by the kernel's OOM killer. On a CPU-only run the gpu tier is host memory too. ranks: the
    torchrun ranks on this machine, each planning with these capacities."""
    from flexh2o.planning.memory_limit import cgroup_memory, total_bytes
    host = (cpu_mem + (gpu_mem if device == "cpu" else 0)) * ranks
    have = total_bytes()
    if host > have:
        from flexh2o.units import fmt_bytes
        flags = "--gpu-mem + --cpu-mem" if device == "cpu" else "--cpu-mem"
        each = f" x {ranks} ranks on this machine" if ranks > 1 else ""
        group = cgroup_memory()
        where = (f"this process's memory cgroup limit ({fmt_bytes(have)}, {group.path})"
                 if group is not None and group.limit == have
                 else f"this machine's memory ({fmt_bytes(have)} with swap)")
        raise ValueError(f"{flags}{each} ({fmt_bytes(host)}) exceed {where}: give at most what it has"
                         + (" divided by the ranks" if ranks > 1 else "")
                         + ", or leave the flags out for the detected defaults")


def check_output_path(path: Optional[str], flag: str) -> None:
    """A file this run will write: not a directory, in a writable directory, itself writable if it exists."""
    if path is None:
        return
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory: give a file path")
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d) or not os.access(d, os.W_OK):
        raise ValueError(f"{flag} {path}: directory {d} does not exist or is not writable")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path} is not writable: give another file")
