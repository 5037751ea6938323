"""The timed probes of a hardware profile: matmul rates by dtype and rows (the int4 kernel's too), memory copy and
conversion rates, host attention, and the engine's per-op overhead. Each is the median of the faster half of
several timed repeats after a warm-up (median_time)."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from flexh2o.models.common import linear
from flexh2o.tuning.hardware import GRAIN


def median_time(fn: Callable[[], object], repeat: int, sync: Callable[[], None] = lambda: None) -> float:
    """The median of the faster half of `repeat` timed calls of fn after one warm-up call: a rate the machine
    reaches, not one another process's burst imposed (the plain median drifted 2-5x with other processes on the
    cores)."""
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    times.sort()
    return max(statistics.median(times[:max(1, (len(times) + 1) // 2)]), 1e-9)


def device_sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def compute_rates(dtype: torch.dtype, device: torch.device, quick: bool) -> dict:
    """FLOP/s of a large square matmul, a decode-shaped skinny one (32 rows), and attention-shaped bmm."""
    n = 1024 if quick else 2048
    if device.type == "cuda":
        n *= 4
    sync, rep = device_sync(device), 3 if quick else 5
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = {"matmul_flops": 2 * n ** 3 / median_time(lambda: a @ b, rep, sync)}
    h = 2048 if quick else 4096
    x = torch.randn(32, h, device=device).to(dtype)  # (tokens, hidden)
    w = torch.randn(h, h, device=device).to(dtype)  # (out, in)
    out["decode_matmul_flops"] = 2 * 32 * h * h / median_time(lambda: linear(x, w), rep, sync)
    bh, s, d = (32 if quick else 64), 512, 64  # (batch x heads, tokens, head_dim)
    q = torch.randn(bh, s, d, device=device).to(dtype)
    kt = torch.randn(bh, d, s, device=device).to(dtype)
    out["attention_flops"] = 2 * bh * s * s * d / median_time(lambda: torch.bmm(q, kt), rep, sync)
    bh, s = (256 if quick else 1024), 1024  # one query per sequence and head over `s` cached tokens
    q1 = torch.randn(bh, 1, d, device=device).to(dtype)
    kc = torch.randn(bh, s, d, device=device).to(dtype)
    out["decode_attention_flops"] = 2 * bh * s * d / median_time(lambda: torch.bmm(q1, kc.transpose(1, 2)), rep, sync)
    return out


ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
INT4_ROWS = (1, 4, 16, 64, 256)  # the int4 kernel's table (rates between are interpolated)


class Matmuls:
    """x @ W.T over the weights of several decoder layers (hidden h: four h x h projections, h -> 4h, 4h -> h), more
    than the CPU caches hold, as a decode step streams them. h = 1024 (opt-350m's size, the models run on a CPU);
    larger layers multiply somewhat faster at the same rows, so the figures are conservative for them."""

    def __init__(self, dtype: torch.dtype, device: torch.device, quick: bool):
        h = 1024
        layer = [(h, h)] * 4 + [(4 * h, h), (h, 4 * h)]  # (out, in)
        layers = max(2, ((64 if quick else 192) << 20) // (12 * h * h * dtype.itemsize))
        self.ws = [torch.randn(*shape, device=device).to(dtype) for _ in range(layers) for shape in layer]
        self.dtype, self.device = dtype, device

    def flops(self, rows: int) -> int:
        return 2 * rows * sum(w.numel() for w in self.ws)

    def runner(self, rows: int) -> Callable[[], None]:
        xs = {n: torch.randn(rows, n, device=self.device).to(self.dtype) for n in {w.shape[1] for w in self.ws}}

        def run():
            for w in self.ws:
                linear(xs[w.shape[1]], w)  # the engine's product (models/common.py), as a decode step runs it
        return run


def matmul_rows_rates(dtype: torch.dtype, device: torch.device, quick: bool) -> dict:
    """{rows: FLOP/s} of x @ W.T by the number of rows of x (see Matmuls)."""
    mm, sync = Matmuls(dtype, device, quick), device_sync(device)
    return {str(r): mm.flops(r) / median_time(mm.runner(r), 3 if quick else 5, sync) for r in ROWS}


def int4_rows_rates(quick: bool) -> dict:
    """{rows: FLOP/s} of torch's int4 kernel (CPU) over the weights of Matmuls stored 4-bit in groups of 64 along
    their input dimension, by the number of rows of x (bf16 activations, as the engine feeds it)."""
    from flexh2o.compress.codec import CompressionSpec, quantize
    from flexh2o.compress.kernels import PackedWeight, to_kernel_order
    mm = Matmuls(torch.float32, torch.device("cpu"), quick)
    spec = CompressionSpec(4, 64, 1)
    packed = [PackedWeight.from_stored(to_kernel_order(quantize(w, spec, torch.bfloat16))) for w in mm.ws]
    shapes = {w.shape[1] for w in mm.ws}
    del mm.ws  # fp32 copies no longer needed

    def runner(rows: int) -> Callable[[], None]:
        xs = {n: torch.randn(rows, n) for n in shapes}
        return lambda: [p.linear(xs[p.packed.shape[1] * 2]) for p in packed]
    flops = 2 * sum(p.meta.shape[0] * p.packed.shape[1] * 2 for p in packed)
    return {str(r): r * flops / median_time(runner(r), 3 if quick else 5) for r in INT4_ROWS}


def memory_rates(device: torch.device, quick: bool) -> dict:
    """Memcpy rate (bytes copied per second) of host memory and of the device, and the fp16 -> fp32 conversion
    into a buffer already touched (weights.store.ConvertBuffers)."""
    nbytes = (64 if quick else 256) << 20
    rep = 3 if quick else 5
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src).fill_(0)
    out = {"cpu_mem_bw": nbytes / median_time(lambda: dst.copy_(src), rep)}
    half = torch.ones(nbytes // 2, dtype=torch.float16)
    wide = torch.empty(nbytes // 2, dtype=torch.float32).fill_(0)  # reused, as the engine's conversion buffers
    out["convert_bw"] = nbytes / median_time(lambda: wide.copy_(half), rep)
    if device.type == "cuda":
        gsrc = torch.ones(nbytes * 4, dtype=torch.uint8, device=device)
        gdst = torch.empty_like(gsrc)
        out["gpu_mem_bw"] = nbytes * 4 / median_time(lambda: gdst.copy_(gsrc), rep, device_sync(device))
        pinned = src.pin_memory()
        gbuf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        out["h2d_bw"] = nbytes / median_time(lambda: gbuf.copy_(pinned, non_blocking=True), rep, device_sync(device))
        out["d2h_bw"] = nbytes / median_time(lambda: pinned.copy_(gbuf, non_blocking=True), rep, device_sync(device))
    else:
        out.update(gpu_mem_bw=out["cpu_mem_bw"], h2d_bw=None, d2h_bw=None)
    return out


def cpu_attention_flops(quick: bool) -> float:
    """FLOP/s of decode attention run on the host in float32 (what --cpu-cache-compute does next to the cache)."""
    bh, s, d = (256 if quick else 1024), 1024, 64
    q = torch.randn(bh, 1, d)
    kc = torch.randn(bh, s, d)
    return 2 * bh * s * d / median_time(lambda: torch.bmm(q, kc.transpose(1, 2)), 3 if quick else 5)


def op_overhead(device: torch.device) -> float:
    """Seconds of framework overhead per op as the engine sees it: decode steps of a tiny model (hidden 64, all in
    the gpu tier) through flexh2o's own Engine, whose compute is negligible, per (layer, batch) and per op of the
    cost model's op count. Small ops timed alone mislead here: with OMP_WAIT_POLICY=PASSIVE a lone small op pays a
    thread wake-up (~50 us on a 2-core VM) that the engine's back-to-back ops mostly do not. (The tiny model's own
    matmuls and memory passes are counted in too; they are a few percent of it.)"""
    from flexh2o.config import ModelConfig
    from flexh2o.tuning.step_cost import OPS
    from flexh2o.engine import Engine
    from flexh2o.placement import Percent
    from flexh2o.prompts import synthetic_prompts
    from flexh2o.run_config import RunConfig
    cfg = ModelConfig("overhead-probe", "opt", hidden=64, num_layers=8, num_heads=4, ffn=256, vocab=512,
                      max_positions=64)
    b, nb, gen = 4, 2, 9
    rc = RunConfig(model=cfg, percent=Percent(100, 0, 100, 0, 100, 0), gpu_batch_size=b, num_gpu_batches=nb,
                   prompt_len=32, gen_len=gen, dtype=torch.float32, device=str(device), gpu_mem=1 << 30,
                   cpu_mem=1 << 30, disk_mem=1 << 30, overlap=False)
    prompts = synthetic_prompts(b * nb, 32, cfg.vocab)
    with Engine(rc) as eng:
        eng.generate(prompts, gen)  # warm-up
        decode = statistics.median(eng.generate(prompts, gen).decode_s for _ in range(3))
    ops_per_step = nb * (OPS["embed"] + cfg.num_layers * OPS["block"] + OPS["head"])
    return decode / (gen - 1) / ops_per_step


def parallel_op(device: torch.device) -> float:
    """Seconds of an elementwise op big enough for torch to run it on all threads (see the module docstring)."""
    x = torch.randn(2 * GRAIN, device=device)
    y = torch.empty_like(x)
    return median_time(lambda: torch.add(x, 1.0, out=y), 101, device_sync(device))
