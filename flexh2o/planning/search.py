"""Policy search: the --percent, GPU batch size and number of GPU batches with the highest predicted throughput.

Enumerates weight splits (gpu/cpu in steps of `step`, disk the rest), cache and activation placements, numbers of
GPU batches and batch sizes; keeps the plans that fit every tier and ranks them by predicted total throughput.
Fits are computed from memory_plan's own pieces (block sizes, working_bytes), memoized, and the returned plans
are re-checked with plan_memory itself.
`flexh2o-plan` (cli/plan.py) prints the best few and the flexh2o-run command line of the best.
"""
from __future__ import annotations

from flexh2o.planning.cost_model import predict_with, tier_counts, weight_layout
from flexh2o.kv.policies import resolve_budget
from flexh2o.planning.memory_plan import act_block_bytes, cache_block_bytes, plan_memory, working_bytes
from flexh2o.models import layer_specs
from flexh2o.placement import TIERS, Percent, weight_homes
from flexh2o.planning.hardware import Rates
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


def _counts(num_layers: int, nb: int, shares: tuple, memo: dict) -> dict:
    """Blocks per tier over all layers."""
    out = dict.fromkeys(TIERS, 0)
    for row in tier_counts(num_layers, nb, shares, memo):
        for t, n in row:
            out[t] += n
    return out


class _Fit:
    """Bytes per tier of a plan without plan_memory's per-call cost: weights per weight split, cache and activation
    blocks from memory_plan's block sizes (proportional to the batch), and memory_plan.working_bytes for the gpu
    buffers, memoized on what they depend on (weight split, one or two cache/activation blocks, batch size)."""

    def __init__(self, rc: RunConfig):
        self.rc, self.specs = rc, layer_specs(rc.model)
        self.homes: dict = {}  # weight split -> name -> tier
        self.weights: dict = {}  # weight split -> tier -> bytes
        self.buffers: dict = {}  # buffer key -> bytes
        self.cache1 = cache_block_bytes(rc.with_(gpu_batch_size=1))
        self.act1 = act_block_bytes(rc.with_(gpu_batch_size=1))

    def _split(self, w: tuple) -> dict:
        if w not in self.homes:
            self.homes[w] = homes = weight_homes(self.specs, (w[0], w[1], 100 - w[0] - w[1]))
            size = {s.name: s.numel for layer in self.specs for s in layer}
            self.weights[w] = {t: sum(size[n] for n, h in homes.items() if h == t) * self.rc.dtype.itemsize
                               for t in TIERS}
        return self.homes[w]

    def tier_bytes(self, rc: RunConfig, caches: dict, acts: dict) -> dict:
        p, b = rc.percent, rc.gpu_batch_size
        w = (p.w_gpu, p.w_cpu)
        homes = self._split(w)
        key = (w, p.cache_gpu == 100 or (rc.cpu_cache_compute and p.cache_cpu == 100), p.act_gpu == 100, b)
        if key not in self.buffers:
            self.buffers[key] = working_bytes(rc, self.specs, homes)
        out = {t: {"weights": self.weights[w][t], "cache": caches[t] * self.cache1 * b,
                   "activations": acts[t] * self.act1 * b, "buffers": 0} for t in TIERS}
        out["gpu"]["buffers"] = self.buffers[key]
        return out

    def fits(self, rc: RunConfig, caches: dict, acts: dict) -> bool:
        got = self.tier_bytes(rc, caches, acts)
        return all(sum(got[t].values()) <= getattr(rc, f"{t}_mem") for t in TIERS)

    def largest(self, rc: RunConfig, caches: dict, acts: dict, limit: int) -> int:
        """Largest batch size up to `limit` that fits every tier (0: none): doubling, then bisection."""
        def fits(b: int) -> bool:
            return self.fits(rc.with_(gpu_batch_size=b), caches, acts)
        if not fits(1):
            return 0
        lo, hi = 1, 2
        while hi <= limit and fits(hi):
            lo, hi = hi, hi * 2
        hi = min(hi, limit + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo


def search(base_rc: RunConfig, hw: dict, step: int = 10, max_num_gpu_batches: int = 32, max_batch: int = 4096,
           limit: int = 20, refine: int = 16) -> list:
    """[(rc, Prediction)] best first (at most `limit`), every one fitting its tiers per plan_memory.

    For each placement and number of GPU batches the largest fitting batch is predicted first; the `refine` best
    combinations are then also predicted at every power-of-two batch size below it.
    """
    if not 1 <= step <= 100:
        raise ValueError(f"search step must be 1..100 percent (got {step})")
    rates = Rates.from_profile(hw, base_rc.compute)
    fit, layouts, memo = _Fit(base_rc), {}, {}
    cuda = base_rc.device.startswith("cuda")
    nbs = [1 << i for i in range(max_num_gpu_batches.bit_length()) if 1 << i <= max_num_gpu_batches]
    L = base_rc.model.num_layers
    scored = []
    for w in weight_splits(step):
        if w not in layouts:
            layouts[w] = weight_layout(base_rc.model, (w[0], w[1], 100 - w[0] - w[1]), base_rc.dtype)
        for c in cache_splits(step):
            for ccc in ([False, True] if cuda and c[1] > 0 else [base_rc.cpu_cache_compute]):
                for a in ((100, 0), (0, 100)):
                    for nb in nbs:
                        rc = base_rc.with_(percent=Percent(*w, *c, *a), num_gpu_batches=nb, cpu_cache_compute=ccc,
                                           gpu_batch_size=1)
                        caches, acts = _counts(L, nb, c + (100 - sum(c),), memo), _counts(1, nb, a + (0,), memo)
                        top = fit.largest(rc, caches, acts, max_batch)
                        if top == 0:
                            break  # more GPU batches only need more memory
                        rc = rc.with_(gpu_batch_size=top)
                        pred = predict_with(rc, rates, layouts[w], fit.tier_bytes(rc, caches, acts), memo)
                        scored.append((pred.total_throughput, rc, pred, caches, acts))
    scored.sort(key=lambda x: -x[0])
    extra = []
    for _, rc, _, caches, acts in scored[:refine]:
        for b in batch_sizes(rc.gpu_batch_size)[:-1]:
            small = rc.with_(gpu_batch_size=b)
            pred = predict_with(small, rates, layouts[(rc.percent.w_gpu, rc.percent.w_cpu)],
                                fit.tier_bytes(small, caches, acts), memo)
            extra.append((pred.total_throughput, small, pred, caches, acts))
    ranked = sorted(scored + extra, key=lambda x: -x[0])
    out = []
    for _, rc, pred, _, _ in ranked:
        plan = plan_memory(rc)
        if plan.overflow() is None:
            pred.bytes = {t: dict(kinds) for t, kinds in plan.bytes.items()}
            out.append((rc, pred))
        if len(out) == limit:
            break
    return out


def command_line(rc: RunConfig, with_caps: bool = True) -> str:
    """The flexh2o-run flags that reproduce `rc` (integers only, as flexh2o-run parses them)."""
    parts = [f"flexh2o-run --model {rc.model.name}"]
    if rc.path != "_DUMMY_":
        parts.append(f"--path {rc.path}")
    parts.append(f"--percent {rc.percent} --gpu-batch-size {rc.gpu_batch_size} "
                 f"--num-gpu-batches {rc.num_gpu_batches} --prompt-len {rc.prompt_len} --gen-len {rc.gen_len}")
    if rc.cpu_cache_compute:
        parts.append("--cpu-cache-compute")
    if rc.kv_policy != "full":
        parts.append(f"--kv-policy {rc.kv_policy} --kv-budget {_budget_tokens(rc)}")
    if rc.kv_policy == "streaming" and rc.num_sinks != 4:
        parts.append(f"--num-sinks {rc.num_sinks}")
    if rc.seed:
        parts.append(f"--seed {rc.seed}")
    dtype = str(rc.dtype).replace("torch.", "")
    if dtype != "float16":
        parts.append(f"--dtype {dtype}")
    if rc.compute_dtype is not None:
        parts.append(f"--compute-dtype {str(rc.compute_dtype).replace('torch.', '')}")
    if not rc.overlap:
        parts.append("--overlap false")
    if with_caps:
        parts.append(f"--gpu-mem {_size(rc.gpu_mem)} --cpu-mem {_size(rc.cpu_mem)} --disk-mem {_size(rc.disk_mem)}")
    return " ".join(parts)


def _budget_tokens(rc: RunConfig) -> int:
    """--kv-budget N that resolve_budget turns back into rc.budget, or ValueError when none does."""
    n = rc.budget.total
    if resolve_budget(rc.kv_policy, rc.prompt_len, kv_budget=n) != rc.budget:
        raise ValueError(f"KV budget heavy {rc.budget.heavy} + recent {rc.budget.recent} cannot be written as "
                         f"--kv-budget for policy {rc.kv_policy} (it splits a budget evenly)")
    return n


def _size(n: int) -> str:
    for unit, mult in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)
