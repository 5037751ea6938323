"""Policy search: the --percent, GPU batch size and number of GPU batches with the highest predicted throughput.

Enumerates weight splits (gpu/cpu in steps of `step`, disk the rest), cache and activation placements, numbers of
GPU batches and batch sizes; keeps the plans that fit every tier and ranks them by predicted total throughput.
Fits and bytes come from the memory plan itself (memory_plan.largest_batch and plan_memory, the same functions as
--gpu-batch-size auto and --dry-run); placements are built once per split through a shared memo.
`flexh2o-plan` (cli/plan.py) prints the best few and the flexh2o-run command line of the best.
"""
from __future__ import annotations

from typing import Callable, Optional

from flexh2o.compress import CompressionSpec
from flexh2o.compress.defaults import cache_group
from flexh2o.compress.kept import compresses_others
from flexh2o.kv.policies import policy_class, policy_params
from flexh2o.models import layer_specs
from flexh2o.placement import Percent, Placement
from flexh2o.tuning.cost_model import predict_with
from flexh2o.kv.cache_quant import printed_flags
from flexh2o.planning.memory_plan import largest_batch, plan_memory
from flexh2o.tuning.hardware import Rates
from flexh2o.run_config import RunConfig


def weight_splits(step: int) -> list:
    """Every (gpu, cpu) percentage pair in multiples of `step` with gpu + cpu <= 100."""
    return [(g, c) for g in range(0, 101, step) for c in range(0, 101 - g, step)]


def cache_splits(step: int) -> list:
    """All gpu, all cpu, all disk, and gpu/cpu splits in steps of `step`."""
    return [(100, 0), (0, 100), (0, 0)] + [(g, 100 - g) for g in range(step, 100, step)]


def batch_sizes(largest: int) -> list:
    """Powers of two up to `largest`, and `largest` itself."""
    out = [1 << i for i in range(largest.bit_length()) if 1 << i <= largest]
    return out + ([largest] if largest not in out else [])


def search(base_rc: RunConfig, hw: dict, step: int = 10, max_num_gpu_batches: int = 32, max_batch: int = 4096,
           limit: int = 20, refine: int = 16, max_seqs: Optional[int] = None,
           progress: Optional[Callable[[int, int], object]] = None) -> list:
    """[(rc, Prediction)] best first (at most `limit`), every one fitting its tiers per plan_memory, and running at
    most `max_seqs` sequences at once (gpu batch x GPU batches) when given (e.g. the prompts there are).

    For each placement and number of GPU batches the largest fitting batch is predicted first; the `refine` best
    combinations are then also predicted at every power-of-two batch size below it. progress(done, total) is called
    after each weight split (a refusal's search of a large model takes a minute or more).
    """
    if not 1 <= step <= 100:
        raise ValueError(f"search step must be 1..100 percent (got {step})")
    rates = Rates.from_profile(hw, base_rc.compute)
    if base_rc.decode_compute != base_rc.compute:  # decode steps in their own dtype take its rates
        rates = (rates, Rates.from_profile(hw, base_rc.decode_compute))
    memo: dict = {}
    specs = layer_specs(base_rc.model)
    cuda = base_rc.device.startswith("cuda")
    nbs = [1 << i for i in range(max_num_gpu_batches.bit_length()) if 1 << i <= max_num_gpu_batches]
    scored, splits = [], weight_splits(step)
    for done, w in enumerate(splits, 1):
        for c in cache_splits(step):
            for ccc in ([False, True] if cuda and c[1] > 0 else [base_rc.cpu_cache_compute]):
                for a in ((100, 0), (0, 100)):
                    for nb in nbs:
                        percent = Percent(*w, *c, *a)
                        rc = base_rc.with_(percent=percent, num_gpu_batches=nb, cpu_cache_compute=ccc,
                                           gpu_batch_size=1).placed(Placement.build(specs, percent, nb, memo))
                        top = largest_batch(rc, min(max_batch, (max_seqs or max_batch * nb) // nb))
                        if top == 0:
                            break  # more GPU batches only need more memory
                        scored.append(_scored(rc.with_(gpu_batch_size=top), rates, memo))
        if progress is not None:
            progress(done, len(splits))
    scored.sort(key=lambda x: -x[0].total_throughput)
    extra = [_scored(rc.with_(gpu_batch_size=b), rates, memo)
             for _, rc in scored[:refine] for b in batch_sizes(rc.gpu_batch_size)[:-1]]
    ranked = sorted(scored + extra, key=lambda x: -x[0].total_throughput)
    return [(rc, pred) for pred, rc in ranked[:limit]]


def _scored(rc: RunConfig, rates, memo: dict) -> tuple:
    """(prediction, rc) with the prediction's bytes from the memory plan. rates: one Rates, or (prefill's,
    decode's) where decode computes in its own dtype."""
    prefill, decode = rates if isinstance(rates, tuple) else (rates, rates)
    return predict_with(rc, prefill, plan_memory(rc).bytes, memo, decode_rates=decode), rc


def command_line(rc: RunConfig, with_caps: bool = True) -> str:
    """The flexh2o-run flags that reproduce `rc` (integers only, as flexh2o-run parses them)."""
    parts = [f"flexh2o-run --model {rc.model.name}"]
    if rc.path != "_DUMMY_":
        parts.append(f"--path {rc.path}")
    parts.append(f"--percent {rc.percent} --gpu-batch-size {rc.gpu_batch_size} "
                 f"--num-gpu-batches {rc.num_gpu_batches} --prompt-len {rc.prompt_len} --gen-len {rc.gen_len}")
    if rc.cpu_cache_compute:
        parts.append("--cpu-cache-compute")
    if rc.kv.policy != "full":
        parts.append(f"--kv-policy {rc.kv.policy} --kv-budget {rc.kv.kv_budget_flag()}")
    parts += policy_flags(rc.kv)
    if rc.seed:
        parts.append(f"--seed {rc.seed}")
    dtype = str(rc.dtype).replace("torch.", "")
    if dtype != "float16":
        parts.append(f"--dtype {dtype}")
    if rc.compute_dtype is not None:
        parts.append(f"--compute-dtype {str(rc.compute_dtype).replace('torch.', '')}")
    parts += compression_flags(rc)
    if not rc.overlap:
        parts.append("--overlap false")
    if with_caps:
        parts.append(f"--gpu-mem {_size(rc.gpu_mem)} --cpu-mem {_size(rc.cpu_mem)} --disk-mem {_size(rc.disk_mem)}")
    return " ".join(parts)


def policy_flags(kv) -> list:
    """The flexh2o-run flags of the policy's parameters (each as its declaration says when to print it)."""
    if kv.lanes:
        return []
    cls = policy_class(kv.policy)
    return [p.flag_text(getattr(kv, p.name)) for p in policy_params() if p.printed(cls, getattr(kv, p.name))]


def compression_flags(rc: RunConfig) -> list:
    """The flexh2o-run flags of rc's compression (cli/compress_flags.py reads them back; the cache's scheme as its
    CacheQuant fields declare their flags: kv/cache_quant.printed_flags)."""
    weights = compresses_others(rc.compress_weight)  # a checkpoint's kept blocks come with its --path
    spec = rc.compress_weight if weights else rc.compress_cache
    if spec is None:
        return []
    out = ["--compress-weight"] * weights + ["--compress-cache"] * bool(rc.compress_cache)
    if spec.bits != CompressionSpec.bits:
        out.append(f"--compress-bits {spec.bits}")
    given = spec.group_size if weights and spec.group_size != CompressionSpec.group_size else None
    if given is not None:  # the weights' groups, and the cache's unless --cache-group-size follows
        out.append(f"--compress-group-size {given}")
    cache = rc.compress_cache
    if cache and cache.group_size != cache_group(cache.keys, given):  # the cache's groups apart from that choice
        out.append(f"--cache-group-size {cache.group_size}")
    if cache:
        out += printed_flags(cache)
    if rc.compress_weight and rc.weight_kernel != "auto":
        out.append(f"--weight-kernel {'off' if rc.weight_kernel == 'generic' else rc.weight_kernel}")
    return out


def _size(n: int) -> str:
    for unit, mult in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)
