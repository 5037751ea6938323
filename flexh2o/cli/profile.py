"""flexh2o-profile: measure this machine's compute rates and bandwidths into a JSON hardware profile.
Parsing imports no torch (--help is quick): what needs it is imported where it runs."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from flexh2o import paths
from flexh2o.cli.checks import check_output_path
from flexh2o.cli.console import Parser, run_main
from flexh2o.units import fmt_bytes


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flexh2o-profile", description=__doc__.split("\n")[0].split(": ", 1)[1])
    p.add_argument("--output", help="write the JSON profile here (default: print it)")
    p.add_argument("--offload-dir", default=paths.offload_dir(),
                   help="where to measure disk bandwidth (a run directory is made and removed)")
    p.add_argument("--no-disk", action="store_true", help="skip the disk measurement")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--dtype", action="append", help="compute dtype to time (repeatable; default: float32 and "
                   "bfloat16 on CPU, float16 on CUDA)")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (< 10 s)")
    p.add_argument("--name", help="profile name (default: host-device)")
    return p


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_main("flexh2o-profile", lambda: _profile(build_parser().parse_args(argv), argv))


def _profile(args, argv: Optional[list]) -> int:
    import torch
    from flexh2o.dtypes import parse_dtype
    from flexh2o.storage.base import TierFullError
    from flexh2o.tuning.measure import measure, summary
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"--device {device}: use cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here")
    dtypes = args.dtype or (["float16"] if device.startswith("cuda") else ["float32", "bfloat16"])
    for d in dtypes:
        parse_dtype(d)
    check_output_path(args.output, "--output")  # every argument before minutes of measuring
    if not args.no_disk:
        check_disk(args.offload_dir, args.quick)
    try:
        prof = measure(device, dtypes, None if args.no_disk else args.offload_dir, args.quick)
    except TierFullError:  # the disk filled up meanwhile: the tier's own message names flexh2o-run's flags
        raise ValueError(no_space(args.offload_dir, args.quick)) from None
    if args.name:
        prof["name"] = args.name
    env = [f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS") if k in os.environ]
    prof["command"] = " ".join(env + ["flexh2o-profile"] + argv)
    text = json.dumps(prof, indent=1)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    print(summary(prof), file=sys.stderr)
    return 0


def check_disk(offload_dir: str, quick: bool) -> None:
    """Before measuring: a run directory can be made under offload_dir, and its filesystem holds what the disk
    measurement writes."""
    from flexh2o.storage.offload_dir import free_disk_bytes, make_run_dir, remove_run_dir
    from flexh2o.tuning.disk_probe import disk_test_bytes
    remove_run_dir(make_run_dir(offload_dir))  # ValueError: "--offload-dir ... is not writable: ..."
    if free_disk_bytes(offload_dir) < disk_test_bytes(quick):
        raise ValueError(no_space(offload_dir, quick))


def no_space(offload_dir: str, quick: bool) -> str:
    from flexh2o.storage.offload_dir import free_disk_bytes
    from flexh2o.tuning.disk_probe import disk_test_bytes
    return (f"--offload-dir {offload_dir}: the disk measurement writes {fmt_bytes(disk_test_bytes(quick))} but its "
            f"filesystem has {fmt_bytes(free_disk_bytes(offload_dir))} free: free space, pass --offload-dir on a "
            "larger filesystem, or skip the disk with --no-disk")


if __name__ == "__main__":
    sys.exit(main())
