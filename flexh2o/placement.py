"""--percent parsing and the placement of weights, cache blocks and activations on tiers."""
from __future__ import annotations

from dataclasses import dataclass

TIERS = ("gpu", "cpu", "disk")


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
