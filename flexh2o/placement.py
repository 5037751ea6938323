"""--percent parsing and `Placement`: the home tier of every weight, cache block and activation block of a run.

Homes are decided here and nowhere else; `tensor_bytes` is the one rule for how many bytes a tensor takes in its
home. The memory plan, the cost model, the search, the weight store and the KV cache all read a `Placement`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional

import torch

from flexh2o.compress import CompressionSpec, stored_bytes, weight_spec

TIERS = ("gpu", "cpu", "disk")
COMPUTE_MEMORY = "compute memory (host memory, --gpu-mem)"  # the gpu tier of a CPU-only run, in its messages


def tier_words(tier: str, device: str, the: bool = False) -> str:
    """How a message names `tier` of a run on `device`: 'cpu tier' ('the cpu tier' with `the`); on a CPU-only run
    the gpu tier is the share of host memory computed in (its flag stays --gpu-mem): COMPUTE_MEMORY."""
    if tier == "gpu" and not device.startswith("cuda"):
        return COMPUTE_MEMORY
    return f"{'the ' if the else ''}{tier} tier"


@dataclass(frozen=True)
class Percent:
    """FlexGen's --percent: weights gpu/cpu, cache gpu/cpu, activations gpu/cpu; disk gets each remainder."""

    w_gpu: int = 100
    w_cpu: int = 0
    cache_gpu: int = 100
    cache_cpu: int = 0
    act_gpu: int = 100
    act_cpu: int = 0

    def __post_init__(self):
        for what, g, c in self.pairs():
            if min(g, c) < 0 or g + c > 100:
                raise ValueError(f"--percent for {what} is {g} {c}: each value must be 0..100 and the gpu and cpu "
                                 "shares may sum to at most 100 (disk gets the rest)")

    def pairs(self) -> list:
        return [("weights", self.w_gpu, self.w_cpu), ("cache", self.cache_gpu, self.cache_cpu),
                ("activations", self.act_gpu, self.act_cpu)]

    def shares(self, what: str) -> tuple:
        """(gpu, cpu, disk) percentages for 'weights', 'cache' or 'activations'."""
        g, c = {w: (g, c) for w, g, c in self.pairs()}[what]
        return g, c, 100 - g - c

    @staticmethod
    def parse(values: list) -> "Percent":
        if len(values) not in (4, 6):
            raise ValueError(f"--percent takes 4 or 6 integers (weights-gpu weights-cpu cache-gpu cache-cpu "
                             f"[act-gpu act-cpu]), got {len(values)}")
        try:
            ints = [int(v) for v in values]
        except ValueError:
            raise ValueError(f"--percent takes integers, got {' '.join(map(str, values))}") from None
        return Percent(*ints)

    def __str__(self) -> str:
        return " ".join(str(v) for _, g, c in self.pairs() for v in (g, c))


def choose_tier(mid_percent: float, shares: tuple) -> str:
    """The tier whose cumulative share first exceeds mid_percent (FlexGen's rule)."""
    acc = 0.0
    for tier, share in zip(TIERS, shares):
        acc += share
        if mid_percent < acc:
            return tier
    return "disk"


def split_by_bytes(sizes: list, shares: tuple) -> list:
    """Assign items (by byte size) to tiers so each tier gets about its share: midpoint rule over cumulative bytes."""
    total = float(sum(sizes)) or 1.0
    out, acc = [], 0
    for s in sizes:
        out.append(choose_tier((acc + s / 2) / total * 100, shares))
        acc += s
    return out


def weight_homes(layer_specs: list, shares: tuple) -> dict:
    """name -> tier for every weight. Decoder layers are split within each layer by bytes (FlexGen's rule, so
    every layer moves the same mix); the embedding and head tensors then go, largest first, to the tier furthest
    below its share, so the whole model follows the bytes closely. A tied tensor is stored once."""
    homes, size = {}, {}
    for layer in layer_specs:
        for s in layer:
            size[s.name] = s.numel
    for specs in layer_specs[1:-1]:
        for s, tier in zip(specs, split_by_bytes([s.numel for s in specs], shares)):
            homes[s.name] = tier
    total = sum(size.values())
    have = {t: sum(size[n] for n, h in homes.items() if h == t) for t in TIERS}
    used = [t for t, share in zip(TIERS, shares) if share > 0]
    rest = sorted({s.name for s in layer_specs[0] + layer_specs[-1]} - set(homes), key=lambda n: -size[n])
    for name in rest:
        tier = max(used, key=lambda t: shares[TIERS.index(t)] / 100 * total - have[t])
        homes[name] = tier
        have[tier] += size[name]
    return homes


def block_homes(num_layers: int, num_batches: int, shares: tuple) -> list:
    """[layer][batch] -> tier for equally sized blocks (cache per layer and GPU batch, activations per batch)."""
    flat = split_by_bytes([1] * (num_layers * num_batches), shares)
    return [flat[i * num_batches:(i + 1) * num_batches] for i in range(num_layers)]


def tensor_bytes(shape, dtype: torch.dtype, compress: Optional[CompressionSpec] = None) -> int:
    """Bytes a tensor of `shape` (or a flat element count) takes in its home tier when stored as `dtype`, compressed
    under `compress` when given (compress/codec.py's layout: padded groups, scale and minimum)."""
    return stored_bytes((shape,) if isinstance(shape, int) else tuple(shape), dtype, compress)


@dataclass(frozen=True)
class WeightHomes:
    """name -> tier for every weight tensor (a tied tensor once), with the per-tier and per-layer element sums."""

    homes: Mapping[str, str]
    layer_specs: tuple = field(repr=False)  # WeightSpec lists per layer index (0 embedding, 1..L blocks, L+1 head)
    _memo: dict = field(default_factory=dict, repr=False, compare=False)  # derived sums, computed on first use

    @staticmethod
    def build(layer_specs: list, shares: tuple) -> "WeightHomes":
        return WeightHomes(MappingProxyType(weight_homes(layer_specs, shares)),
                           tuple(tuple(layer) for layer in layer_specs))

    def __getitem__(self, name: str) -> str:
        return self.homes[name]

    def bytes_by_tier(self, dtype: torch.dtype, compress: Optional[CompressionSpec] = None) -> dict:
        """tier -> bytes of the weights homed there stored as `dtype` (under --compress-weight's `compress`)."""
        key = ("bytes", dtype, compress)
        if key not in self._memo:
            out = dict.fromkeys(TIERS, 0)
            for s in self.unique_specs():
                out[self.homes[s.name]] += tensor_bytes(s.shape, dtype, weight_spec(s.shape, compress, s.name))
            self._memo[key] = out
        return dict(self._memo[key])

    def derived(self, key, compute):
        """A value derived from these homes, computed by compute(self) on first use and kept under `key`."""
        if key not in self._memo:
            self._memo[key] = compute(self)
        return self._memo[key]

    def unique_specs(self) -> list:
        seen: dict = {}
        for layer in self.layer_specs:
            for s in layer:
                seen.setdefault(s.name, s)
        return list(seen.values())


@dataclass(frozen=True)
class Placement:
    """Where everything of one run lives: weights (WeightHomes), cache[layer][batch] -> tier for decoder layers
    0..L-1, activations[batch] -> tier. Build it with `Placement.build`; pass `memo` (a dict) when building many
    placements of one model, so shared parts are computed once."""

    weights: WeightHomes
    cache: tuple
    activations: tuple
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    @staticmethod
    def build(layer_specs: list, percent: Percent, num_gpu_batches: int, memo: Optional[dict] = None) -> "Placement":
        memo = {} if memo is None else memo
        w, c, a = (percent.shares(k) for k in ("weights", "cache", "activations"))
        if ("w", w) not in memo:
            memo["w", w] = WeightHomes.build(layer_specs, w)
        layers = len(layer_specs) - 2
        for key, n, shares in (("c", layers, c), ("a", 1, a)):
            if (key, shares, num_gpu_batches) not in memo:
                rows = block_homes(n, num_gpu_batches, shares)
                memo[key, shares, num_gpu_batches] = tuple(map(tuple, rows))
        return Placement(memo["w", w], memo["c", c, num_gpu_batches], memo["a", a, num_gpu_batches][0])

    def cache_counts(self) -> tuple:
        """Per decoder layer, ((tier, cache blocks homed there), ...)."""
        if "counts" not in self._memo:
            self._memo["counts"] = tuple(tuple(sorted((t, row.count(t)) for t in set(row))) for row in self.cache)
        return self._memo["counts"]

    def cache_bytes_by_tier(self, block_bytes: tuple) -> dict:
        """tier -> bytes of the cache blocks homed there, given one block's bytes of each decoder layer."""
        out = dict.fromkeys(TIERS, 0)
        for layer, row in enumerate(self.cache_counts()):
            for tier, n in row:
                out[tier] += n * block_bytes[layer]
        return out

    def activation_counts(self) -> tuple:
        """((tier, activation blocks homed there), ...)."""
        return tuple(sorted((t, self.activations.count(t)) for t in set(self.activations)))

    def blocks_on(self, tier: str) -> int:
        """Cache blocks homed on `tier` over all layers and GPU batches."""
        return sum(n for row in self.cache_counts() for t, n in row if t == tier)
