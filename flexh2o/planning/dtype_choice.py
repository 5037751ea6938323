"""The one decision of a run's storage (--dtype) and compute (--compute-dtype) dtypes, 'auto' or explicit.

CUDA: the storage dtype where the device computes it fast (bfloat16 needs compute capability 8.0), else float32.
CPU: a probe (a few hundred ms, cached per machine in machine.cache_dir()) times decode- and prefill-shaped linears
in each candidate dtype and the conversion of the weights from each storage dtype into a reused buffer (what the
engine does every step when the two differ); each (storage, compute) pair gets an estimate of the run's linear
time (conversion once per step, decode matmuls per step and GPU batch, prefill matmuls by rows) and the fastest
allowed pair wins; an explicit --dtype X without --compute-dtype computes in X or wider (computes_for).
--dtype auto stores weights and cache at the compute dtype when none of them is read plain from
disk and the plan still fits (then a step converts nothing); with plain weights or cache blocks on disk, or when the
wider dtype would overflow a tier, it keeps 16 bits (half the bytes over the slow link). Compressed ones on disk
(--compress-weight, --compress-cache) are not halved: 16 bits shrink only their scales and minimums (4-bit weights
in groups of 64: 0.5625 bytes a value against 0.625 in fp32) while every step converts the 16-bit parts (measured
on a Zen 3: opt-350m, 4-bit weights on disk and the quantized cache, batch 16, a decode step 0.50 s busy computing
with fp16 storage against 0.33 s with fp32, for 192 against 214 MiB read: benchmarks/RESULTS.md row 148,
2026-12-07, 5fc9cd1). An explicit pair that the probe puts at
NOTE_RATIO times the best one or slower gets a one-line note naming the faster choice.

Per phase: a decode step multiplies a few rows by every weight, so it is bound by the bytes it reads, not by the
multiply; with bfloat16 storage (fp32's exponent range, so no new overflow) decode steps may compute in bfloat16
straight from the stored weights while prefill converts them once and computes in fp32 (measured here: decode of
the README command 34.6 tok/s bf16/bf16 vs 18.2 bf16 converted to fp32 and 28.6 fp32/fp32; prefill 68 vs 370 vs
306). The probe's decode weights are larger than the CPU's caches, as a model's are. An explicit --compute-dtype
fixes both phases.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from flexh2o.dtypes import dtype_name, parse_dtype
from flexh2o.models.common import linear  # the engine's product, as its steps run it
from flexh2o.planning import machine

CANDIDATES = (torch.float32, torch.bfloat16, torch.float16)
SIXTEEN = (torch.bfloat16, torch.float16)
DECODE_ROWS, PREFILL_ROWS = 4, 64
PROBE_SHAPE = (1024, 1024)  # (out, in) of each probe weight; PROBE_WEIGHTS of them (96 MiB in float32: past L3)
PROBE_WEIGHTS = 24
NOTE_RATIO = 2.0
PROBE_VERSION = 4  # 3: the engine's own product (models.common.linear: oneDNN for fp32 on AVX-512); 4: and for bf16
DECODE_DIRECT = (torch.bfloat16,)  # storage dtypes decode may compute in directly (per-phase choice)


@dataclass(frozen=True)
class DtypeChoice:
    """What ran and why (the summary and the JSON record carry `reason`); `note`: a faster pair, when much faster."""

    dtype: torch.dtype
    compute: torch.dtype
    reason: str
    note: Optional[str] = None
    decode: Optional[torch.dtype] = None  # decode steps' compute dtype when it differs from `compute`


def _fastest_s(fn: Callable[[], object], repeat: int = 3) -> float:
    """The fastest of `repeat` timed calls after a warm-up (the probe compares dtypes: another process's burst in one
    candidate's timing must not decide the choice)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return max(min(times), 1e-9)


def probe_timings() -> dict:
    """Seconds, for PROBE_WEIGHTS weights of PROBE_SHAPE: {'decode': {dtype: s}, 'prefill': {dtype: s} (one weight),
    'convert': {'src->dst': s}} (decode: DECODE_ROWS rows over all weights; prefill: PREFILL_ROWS rows, one weight;
    convert: all weights copied into a reused buffer of the compute dtype)."""
    base = torch.rand(PROBE_WEIGHTS, *PROBE_SHAPE, generator=torch.Generator().manual_seed(0)) - 0.5
    ws = {d: list(base.to(d).unbind()) for d in CANDIDATES}
    out: dict = {"decode": {}, "prefill": {}, "convert": {}}
    for d in CANDIDATES:
        x1 = torch.randn(DECODE_ROWS, PROBE_SHAPE[1]).to(d)
        xp = torch.randn(PREFILL_ROWS, PROBE_SHAPE[1]).to(d)
        out["decode"][dtype_name(d)] = _fastest_s(lambda: [linear(x1, w) for w in ws[d]])
        out["prefill"][dtype_name(d)] = _fastest_s(lambda: linear(xp, ws[d][0]))
    for src in CANDIDATES:
        for dst in CANDIDATES:
            if src != dst and torch.float32 in (src, dst):  # never between two 16-bit dtypes
                buf = torch.empty(PROBE_SHAPE, dtype=dst)
                out["convert"][f"{dtype_name(src)}->{dtype_name(dst)}"] = _fastest_s(
                    lambda: [buf.copy_(w) for w in ws[src]])
    return out


def cached_probe(measure: Callable[[], dict] = probe_timings) -> tuple:
    """(timings, was_cached): this machine's probe from the cache dir, measured and written there the first time
    (and again when it was measured on a busy machine that is now much quieter: machine.stale_by_load)."""
    fp = machine.fingerprint("cpu")
    name = f"dtype_probe-v{PROBE_VERSION}-{machine.fingerprint_key(fp)}.json"  # versions never overwrite each other
    got = machine.read_cached(name)
    if (got and got.get("version") == PROBE_VERSION and isinstance(got.get("timings"), dict)
            and not machine.stale_by_load(got.get("load_at_measure"))):
        return got["timings"], True
    with machine.LoadSeen(torch.get_num_threads()) as seen:  # crowded out, the probe's products read slow
        timings = measure()
    machine.write_cached(name, {"version": PROBE_VERSION, "fingerprint": fp, "timings": timings,
                                "load_at_measure": seen.load})
    return timings, False


def estimate(timings: dict, rc, storage: torch.dtype, compute: torch.dtype,
             decode: Optional[torch.dtype] = None) -> float:
    """Relative seconds of the run's linears with weights stored in `storage`, prefill computed in `compute` and
    decode steps in `decode` (default: compute), from the probe (see the module docstring): a phase whose compute
    dtype differs from the storage converts the weights once per step."""
    s, c, d = dtype_name(storage), dtype_name(compute), dtype_name(decode or compute)
    per_row = timings["prefill"][c] * PROBE_WEIGHTS / PREFILL_ROWS  # prefill seconds per row over all weights
    # a decode step: the weights' read at DECODE_ROWS rows, or more rows at the cheaper of the two per-row costs
    # (fp32 gets cheaper per row with more rows; bf16 on a CPU without bf16 units does not)
    dec = timings["decode"][d]
    per_row_d = min(timings["prefill"][d] * PROBE_WEIGHTS / PREFILL_ROWS, dec / DECODE_ROWS)
    step = max(dec, per_row_d * rc.gpu_batch_size) * rc.num_gpu_batches
    prefill = per_row * rc.num_seqs * rc.prompt_len
    return _convert_s(timings, s, c) + prefill + (rc.gen_len - 1) * (_convert_s(timings, s, d) + step)


def _convert_s(timings: dict, src: str, dst: str) -> float:
    """Probe seconds of converting the weights from dtype name `src` to `dst` (0 when they are the same)."""
    return 0.0 if src == dst else timings["convert"].get(f"{src}->{dst}", float("inf"))


def options(rc, storage: Optional[torch.dtype], compute: Optional[torch.dtype]) -> list:
    """(storage, compute, decode) triples open to the choice: allowed_pairs with each pair's decode_options."""
    return [(s, c, d) for s, c in allowed_pairs(rc, storage, compute) if compute is not None or probed(s, c)
            for d in decode_options(s, c, compute is not None)]


def probed(storage: torch.dtype, compute: torch.dtype) -> bool:
    """Whether the probe times this pair's conversion (to and from float32 only): an automatic choice never casts
    one 16-bit dtype into the other (its estimate would be infinite, the summary's relative time 'inf')."""
    return storage == compute or torch.float32 in (storage, compute)


def decode_options(storage: torch.dtype, compute: torch.dtype, explicit_compute: bool) -> list:
    """Decode compute dtypes open to a (storage, compute) pair: the compute dtype, and the storage dtype itself
    when it is one of DECODE_DIRECT and --compute-dtype was not given."""
    out = [compute]
    if not explicit_compute and storage != compute and storage in DECODE_DIRECT:
        out.append(storage)
    return out


def choose_dtypes(rc, dtype_arg: Optional[str], compute_arg: Optional[str],
                  probe: Optional[Callable[[], tuple]] = None, fits: Optional[Callable] = None,
                  score: Optional[Callable] = None, stored: Optional[torch.dtype] = None) -> DtypeChoice:
    """Storage and compute dtypes for `rc` (its placement, batch, lengths and capacities) from the two flags
    ('auto' or None = choose; else a dtype name). The fastest allowed pair by the probe whose `fits(rc with the
    pair)` holds (default: the memory plan at rc's placement fits; a converting pair needs compute-side buffers),
    else the fastest. With `score` (rc with the dtypes -> predicted seconds a generated token, None where nothing
    fits: the policy search's best plan), the option it predicts fastest wins instead: a probe's rank of the
    linears alone cannot see that a dtype's fit forces a plan ten times slower. `stored`: the checkpoint's dtype,
    which --dtype auto keeps (computed in it or wider: computes_for), as transformers and vLLM do. The CLI's one
    call; RunConfig then holds both explicitly."""
    storage = None if dtype_arg in (None, "auto") else parse_dtype(dtype_arg)
    kept = storage is None and stored is not None  # --dtype auto on a checkpoint: its own dtype, never narrower
    storage = stored if kept else storage
    compute = None if compute_arg in (None, "auto") else parse_dtype(compute_arg)
    if rc.device.startswith("cuda"):
        return _cuda_choice(rc, storage, compute)
    timings, cached = (probe or cached_probe)()
    fits = fits or (lambda r: _plan_fits(r))
    ranked = sorted(options(rc, storage, compute), key=lambda t: estimate(timings, rc, *t))
    if score is not None:
        s, c, d = _best_scored(rc, ranked, score) or ranked[0]
    else:
        s, c, d = next((t for t in ranked if fits(rc.with_(dtype=t[0], compute_dtype=t[1]))), ranked[0])
    mine = estimate(timings, rc, s, c, d)
    others = {}
    for s2, c2, d2 in options(rc, storage, None):
        others[dtype_name(c2)] = min(others.get(dtype_name(c2), float("inf")), estimate(timings, rc, s2, c2, d2))
    reason = (f"compute {dtype_name(c)} ({'explicit' if compute else 'auto'}; probe{' (cached)' if cached else ''} "
              "of this CPU, relative linear time " + ", ".join(f"{k} {v / mine:.2f}" for k, v in others.items())
              + f"), storage {dtype_name(s)} ({_storage_why(rc, s, c, kept) if kept or not storage else 'explicit'})")
    if d != c:
        reason += (f", decode steps in {dtype_name(d)} straight from the stored weights (probe: a decode step "
                   f"{estimate_step(timings, s, c) / estimate_step(timings, s, d):.2f}x faster than converting "
                   f"to {dtype_name(c)})")
    if (s, c, d) != ranked[0]:
        first = f"{dtype_name(ranked[0][0])}/{dtype_name(ranked[0][1])}"
        reason += (f"; {first} would not fit" if score is None else
                   f"; chosen by the policy search's predicted time (the probe ranks {first} first)")
    note = None
    if (storage is not None and not kept) or compute is not None:
        best = min(options(rc, None, None), key=lambda t: estimate(timings, rc, *t))
        ratio = mine / estimate(timings, rc, *best)
        if ratio >= NOTE_RATIO:
            note = (f"note: --dtype {dtype_name(s)} --compute-dtype {dtype_name(c)} is about {ratio:.1f}x slower "
                    f"on this CPU than --dtype {dtype_name(best[0])} --compute-dtype {dtype_name(best[1])} (dtype "
                    "probe); leave both at auto to get the faster one")
    return DtypeChoice(s, c, reason, note, d if d != c else None)


def _best_scored(rc, ranked: list, score: Callable) -> Optional[tuple]:
    """The (storage, compute, decode) option of `ranked` whose rc `score` predicts fastest (ties to the earlier),
    None when none fits."""
    scored = [(score(rc.with_(dtype=s, compute_dtype=c, decode_dtype=d if d != c else None)), i, (s, c, d))
              for i, (s, c, d) in enumerate(ranked)]
    fitting = [x for x in scored if x[0] is not None]
    return min(fitting)[2] if fitting else None


def estimate_step(timings: dict, storage: torch.dtype, dtype: torch.dtype) -> float:
    """Probe seconds of one decode step's linears computing in `dtype` from weights stored in `storage`."""
    return _convert_s(timings, dtype_name(storage), dtype_name(dtype)) + timings["decode"][dtype_name(dtype)]


def fastest_uniform(batch: int, prompt_len: int, gen_len: int, probe: Optional[Callable[[], tuple]] = None) -> str:
    """Name of the dtype that is fastest stored and computed alike (a peer such as transformers, or an evaluation
    that keeps everything in memory) for this batch and these lengths, by the probe."""
    from types import SimpleNamespace
    timings, _ = (probe or cached_probe)()
    shape = SimpleNamespace(gpu_batch_size=batch, num_gpu_batches=1, num_seqs=batch, prompt_len=prompt_len,
                            gen_len=gen_len)
    return dtype_name(min(CANDIDATES, key=lambda d: estimate(timings, shape, d, d)))


def allowed_pairs(rc, storage: Optional[torch.dtype], compute: Optional[torch.dtype]) -> list:
    """(storage, compute) pairs open to the choice: explicit flags fix their side; auto storage is the compute
    dtype when nothing plain is read from disk and it fits, else a 16-bit dtype."""
    out = []
    for c in ([compute] if compute else computes_for(storage)):
        if storage is not None:
            out.append((storage, c))
        elif not _plain_on_disk(rc) and _fits(rc, c):
            out.append((c, c))
        else:
            out.extend((s, c) for s in SIXTEEN)
    return out


def computes_for(storage: Optional[torch.dtype]) -> tuple:
    """Compute dtypes open to `--compute-dtype auto` beside a storage dtype: with --dtype auto any candidate; with
    an explicit --dtype X only X or fp32 (no precision is given away unasked: fp32 storage computes in fp32, bf16
    storage in bf16 or fp32, never in fp16; fp16 storage in fp32, as RunConfig.compute's CPU default, since fp16's
    range is narrower than the activations need)."""
    if storage is None:
        return CANDIDATES
    return (torch.float32,) if storage == torch.float16 else tuple(dict.fromkeys((storage, torch.float32)))


def _storage_why(rc, s, c, kept: bool = False) -> str:
    if kept:
        return "auto: the checkpoint's own dtype; --dtype names a narrower one"
    if _plain_on_disk(rc):
        return "auto: weights or cache on disk, 16 bits halve the bytes read"
    if s == c and not _memory_resident(rc):
        return ("auto: only compressed weights or cache on disk, whose scales alone 16 bits would shrink, and the "
                "plan fits, so no step converts")
    if s == c:
        return "auto: every weight and cache block in memory and the plan fits, so no step converts"
    return f"auto: {dtype_name(c)} storage would overflow a tier"


def _memory_resident(rc) -> bool:
    p = rc.percent
    return p.shares("weights")[2] == 0 and p.shares("cache")[2] == 0


def _plain_on_disk(rc) -> bool:
    """Whether uncompressed weights or cache blocks have a disk share (16 bits halve what is read of them)."""
    p = rc.percent
    return bool((p.shares("weights")[2] and rc.compress_weight is None)
                or (p.shares("cache")[2] and rc.compress_cache is None))


def _fits(rc, dtype: torch.dtype) -> bool:
    return _plan_fits(rc.with_(dtype=dtype, compute_dtype=dtype))


def _plan_fits(rc) -> bool:
    from flexh2o.planning.memory_plan import plan_memory
    return plan_memory(rc).overflow() is None


def cuda_fast(dtype: torch.dtype, capability: tuple) -> bool:
    """Whether a CUDA device of this compute capability has fast matmuls in dtype."""
    return dtype != torch.bfloat16 or tuple(capability) >= (8, 0)


def _cuda_choice(rc, storage, compute) -> DtypeChoice:
    cap = torch.cuda.get_device_capability(torch.device(rc.device))
    s = storage or torch.float16
    if compute is not None:
        return DtypeChoice(s, compute, f"explicit --compute-dtype, storage {dtype_name(s)}")
    if cuda_fast(s, cap):
        return DtypeChoice(s, s, f"auto: the storage dtype {dtype_name(s)} is fast on compute capability "
                           f"{cap[0]}.{cap[1]}")
    return DtypeChoice(s, torch.float32, f"auto: {dtype_name(s)} needs compute capability 8.0 for fast matmuls "
                       f"(this GPU has {cap[0]}.{cap[1]}), so float32")
