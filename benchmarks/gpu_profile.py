"""Where a memory-resident decode step's time goes on a CUDA device (prepared for a lent GPU, about 2 minutes).

Runs Engine.generate on dummy weights with every weight, the cache and the activations on the gpu tier, once
untimed, then once under torch.profiler and once under cProfile, and writes to --out:
- steps.txt: the decode step's wall time without and with torch's cuDNN attention backend (first at key lengths not
  seen before, then at the same lengths again), against the time to read the weights once at the device's copy
  rate (a device-to-device copy of the same bytes);
- ops.txt: the aten/cuda runtime calls by self CPU time and by count (syncs and host-device copies are what
  serialize the CPU with the GPU);
- python.txt: cProfile's top functions by own time.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resident import add_flags, prompts_and_config  # noqa: E402

from flexh2o.engine import Engine  # noqa: E402
from flexh2o.kv import sdpa as attention  # noqa: E402  (its CUDA_SDPA is what sdpa reads)


def _decode_s(eng, prompts, gen: int) -> float:
    """Median seconds a decode step: the synchronized times between consecutive steps' ends (the prefill's step
    left out, so a backend's one-time build for the prefill shape does not count)."""
    ends = []

    def on_step(step):
        torch.cuda.synchronize()
        ends.append(time.perf_counter())
    eng.generate(prompts, gen, on_step=on_step)
    return statistics.median(b - a for a, b in zip(ends, ends[1:]))


def _copy_rate(nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 5 * nbytes / (time.perf_counter() - t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flags(ap, 128)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--out", default="gpu_profile")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_profile: no CUDA device here", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    lines = [f"{torch.cuda.get_device_name(0)} torch {torch.__version__} model {args.model} {args.dtype} "
             f"batch {args.batch} prompt {args.prompt_len}"]
    prompts, rc = prompts_and_config(args, [100, 0, 100, 0, 100, 0], args.gen_len, device="cuda", overlap=False,
                                     gpu_mem=64 << 30, offload_dir=os.path.join(args.out, "o"))
    with Engine(rc) as eng:
        eng.generate(prompts, 2)
        wbytes = eng.plan.bytes["gpu"]["weights"]
        lines.append(f"weights {wbytes / 2**30:.2f} GiB, read once at the copy rate "
                     f"{wbytes / _copy_rate(wbytes) * 1e3:.2f} ms")
        default = attention.CUDA_SDPA
        for name, backends in (("without cuDNN attention (flexh2o)", default),
                               ("with cuDNN attention (torch's default)", (SDPBackend.CUDNN_ATTENTION, *default))):
            attention.CUDA_SDPA = backends
            first, again = _decode_s(eng, prompts, args.gen_len), _decode_s(eng, prompts, args.gen_len)
            lines.append(f"{name}: median decode step {first * 1e3:.2f} ms at key lengths not seen before, "
                         f"{again * 1e3:.2f} ms at the same lengths again")
        attention.CUDA_SDPA = default
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            eng.generate(prompts, args.gen_len)
            torch.cuda.synchronize()
        ka = prof.key_averages()
        with open(os.path.join(args.out, "ops.txt"), "w") as f:
            f.write(ka.table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=60) + "\n")
            f.write(ka.table(sort_by="count", row_limit=30, max_name_column_width=60) + "\n")
        pr = cProfile.Profile()
        pr.enable()
        eng.generate(prompts, args.gen_len)
        torch.cuda.synchronize()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(45)
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45)
        with open(os.path.join(args.out, "python.txt"), "w") as f:
            f.write(s.getvalue())
    with open(os.path.join(args.out, "steps.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
