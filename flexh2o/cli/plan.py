"""flexh2o-plan: search --percent and batch sizes on a hardware profile and print the best plans (nothing runs).
Parsing imports no torch (--help is quick): what needs it is imported where it runs."""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from flexh2o import config as model_configs
from flexh2o import paths
from flexh2o.cli.compress_flags import add_compression_flags, compression_specs, weight_kernel_mode
from flexh2o.cli.console import Parser, run_main
from flexh2o.cli.help_text import model_help
from flexh2o.cli.kv_flags import add_kv_flags, kv_spec
from flexh2o.units import fmt_bytes, parse_bytes


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flexh2o-plan", description="Search --percent and batch sizes for the highest predicted "
               "throughput on a hardware profile, without running anything.")
    a = p.add_argument
    a("--model", required=True, help=model_help(None))
    a("--hardware", default="auto", help="hardware profile JSON (flexh2o-profile), a shipped name (t4_paper, "
      "a100_80gb, cpu_measured), or auto: this machine's cached profile (measured once, under a minute; default)")
    a("--prompt-len", type=int, default=512, help="prompt tokens per sequence")
    a("--gen-len", type=int, default=32, help="tokens generated per sequence")
    add_kv_flags(p)
    add_compression_flags(p)
    a("--seed", type=int, default=0, help="seed of the random policy")
    a("--gpu-mem", help="gpu tier capacity (default: the profile's)")
    a("--cpu-mem", help="cpu tier capacity (default: the profile's)")
    a("--disk-mem", help="disk tier capacity (default: the profile's)")
    a("--dtype", default="auto", help="storage dtype of weights and cache (float16, bfloat16 or float32), or auto: "
      "flexh2o-run's choice (planning/dtype_choice.py; float16 on a CUDA profile)")
    a("--device", choices=["cpu", "cuda"], help="default: the profile's device")
    a("--overlap", default="true", choices=["true", "false"], help="plans overlap I/O with compute")
    a("--step", type=int, default=10, help="percent step of the placement search")
    a("--max-num-gpu-batches", type=int, default=32, help="most GPU batches per weight load the search tries")
    a("--top", type=int, default=5, help="plans to print")
    return p


def _capacity(arg: Optional[str], hw: dict, tier: str, args, device: str) -> int:
    """--TIER-mem, else the profile's, else (--hardware auto) this machine's default, as flexh2o-run's."""
    value = arg if arg is not None else hw.get(f"{tier}_mem")
    if value is None and args.hardware == "auto":
        from types import SimpleNamespace
        from flexh2o.cli.capacities import capacities
        here = SimpleNamespace(gpu_mem=None, cpu_mem=None, disk_mem=None, dry_run=True,
                               offload_dir=paths.offload_dir())
        return capacities(here, device)[("gpu", "cpu", "disk").index(tier)]
    if value is None:
        raise ValueError(f"give --{tier}-mem (the hardware profile has no {tier}_mem)")
    return parse_bytes(value) if isinstance(value, str) else int(value)


def plan_from_args(args) -> tuple:
    """(base RunConfig, hardware profile) from parsed flexh2o-plan arguments (checked before a profile is
    measured)."""
    from flexh2o.dtypes import parse_dtype
    from flexh2o.run_config import RunConfig
    cfg = model_configs.from_name(args.model)
    if args.top < 1 or args.max_num_gpu_batches < 1:
        raise ValueError("--top and --max-num-gpu-batches must be at least 1")
    kv = kv_spec(args, args.prompt_len)
    dtype = parse_dtype("float16" if args.dtype == "auto" else args.dtype)  # auto: chosen below
    hw = _profile(args, None)
    device = args.device or ("cuda" if hw.get("device") == "cuda" else "cpu")
    weights, cache = compression_specs(args, device)
    rc = RunConfig(model=cfg, prompt_len=args.prompt_len, gen_len=args.gen_len, dtype=dtype,
                   device=device, overlap=args.overlap == "true", kv=kv,
                   gpu_mem=_capacity(args.gpu_mem, hw, "gpu", args, device),
                   cpu_mem=_capacity(args.cpu_mem, hw, "cpu", args, device),
                   disk_mem=_capacity(args.disk_mem, hw, "disk", args, device), compress_weight=weights,
                   compress_cache=cache, weight_kernel=weight_kernel_mode(args))
    if args.dtype == "auto" and device == "cpu":  # flexh2o-run's choice (its default placement), and its rates
        from flexh2o.planning.dtype_choice import choose_dtypes
        choice = choose_dtypes(rc, "auto", "auto")
        rc = rc.with_(dtype=choice.dtype, compute_dtype=choice.compute, decode_dtype=choice.decode)
        hw = _profile(args, [rc.compute, rc.decode_compute])
    return rc, hw


def _profile(args, compute) -> dict:
    """--hardware's profile; auto: this machine's, measured once (with the rates of `compute`, a list of dtypes)."""
    from flexh2o.tuning.hardware import load_profile
    if args.hardware != "auto":
        return load_profile(args.hardware)
    import torch
    from flexh2o.dtypes import dtype_name
    from flexh2o.tuning.profile_cache import auto_profile
    names = None if compute is None else list(dict.fromkeys(dtype_name(c) for c in compute))
    return auto_profile(args.device or ("cuda" if torch.cuda.is_available() else "cpu"), names, None, True)


def describe(results: list) -> str:
    from flexh2o.placement import TIERS
    rows = [f"{'#':>2} {'percent':<22} {'batch':>10} {'ccc':>3} {'tok/s':>9} {'prefill s':>9} {'decode s':>9} "
            f"{'bound':>8}  {'gpu':>9} {'cpu':>9} {'disk':>9}"]
    for i, (rc, p) in enumerate(results, 1):
        used = [fmt_bytes(sum(p.bytes[t].values())) for t in TIERS]
        rows.append(f"{i:>2} {str(rc.percent):<22} {f'{rc.gpu_batch_size}x{rc.num_gpu_batches}':>10} "
                    f"{'y' if rc.cpu_cache_compute else 'n':>3} {p.total_throughput:>9.2f} {p.prefill_s:>9.2f} "
                    f"{p.decode_s:>9.2f} {p.bottleneck['decode']:>8}  " + " ".join(f"{u:>9}" for u in used))
    return "\n".join(rows)


def main(argv: Optional[list] = None) -> int:
    return run_main("flexh2o-plan", lambda: _plan(build_parser().parse_args(argv)))


def _plan(args) -> int:
    from flexh2o.cli.checks import check_int
    from flexh2o.tuning.search import command_line, search
    check_int("--step", args.step, 1, 100, fix="the placement search's percent step, e.g. 10")
    rc, hw = plan_from_args(args)
    results = search(rc, hw, args.step, args.max_num_gpu_batches, limit=args.top)
    if not results:
        raise ValueError(f"nothing fits: even one sequence of {rc.model.name} overflows the tiers; raise "
                         "--gpu-mem/--cpu-mem/--disk-mem")
    best_rc, best = results[0]
    print(f"{rc.model.name} {rc.prompt_len}+{rc.gen_len} kv policy {rc.kv.policy} "
          f"(cache slots {rc.cache_slots()}) on {hw.get('name', args.hardware)} ({rc.device})")
    print(describe(results))
    print(f"best: predicted {best.total_throughput:.2f} tokens/s total "
          f"(prefill {best.prefill_throughput:.1f}, decode {best.decode_throughput:.2f} tokens/s)")
    print(command_line(best_rc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
