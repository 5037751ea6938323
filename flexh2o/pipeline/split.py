"""The stage split: contiguous ranges of layers, one per rank, balanced by weight bytes or given by --stage-layers.

Layer indices are the engine's: 0 is the embedding, 1..num_layers the decoder blocks, num_layers + 1 the head.
The first stage holds the embedding, the last the head (a tied embedding is stored on both).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from flexh2o.config import ModelConfig
from flexh2o.models import layer_specs


@dataclass(frozen=True)
class Stage:
    """Stage `index` of `num_stages` computes layers first .. stop - 1 (engine indices)."""

    index: int
    num_stages: int
    first: int
    stop: int

    def __post_init__(self):
        if not (0 <= self.index < self.num_stages and 0 <= self.first < self.stop):
            raise ValueError(f"bad stage {self}")

    @property
    def layers(self) -> range:
        return range(self.first, self.stop)

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def prev(self) -> int:
        """The rank this stage receives from (the last stage receives hidden states, the first the next tokens)."""
        return (self.index - 1) % self.num_stages

    @property
    def next(self) -> int:
        return (self.index + 1) % self.num_stages

    def describe(self, num_layers: int) -> str:
        dec = range(max(self.first, 1), min(self.stop, num_layers + 1))
        parts = (["embedding"] if self.first == 0 else []) + [f"decoder layers {dec.start - 1}..{dec.stop - 2}"]
        return f"stage {self.index}: " + ", ".join(parts + (["head"] if self.stop == num_layers + 2 else []))


def layer_bytes(cfg: ModelConfig) -> list:
    """Elements of weights per engine layer index (0 = embedding .. num_layers + 1 = head)."""
    return [sum(s.numel for s in specs) for specs in layer_specs(cfg)]


def parse_stage_layers(text: str) -> list:
    """'12,12' -> [12, 12]; a one-line error for anything else."""
    try:
        counts = [int(p) for p in text.split(",")]
    except ValueError:
        raise ValueError(f"--stage-layers {text}: give decoder-layer counts per stage as integers, e.g. 12,12") \
            from None
    return counts


def split_stages(cfg: ModelConfig, num_stages: int, counts: Optional[list] = None) -> list:
    """One Stage per rank. counts: decoder layers per stage (--stage-layers); None: balanced by weight bytes."""
    n = cfg.num_layers
    if num_stages < 1 or num_stages > n:
        raise ValueError(f"{num_stages} stages for {n} decoder layers of {cfg.name}: run at most {n} ranks")
    if counts is None:
        counts = balanced_counts(layer_bytes(cfg), num_stages)
    given = ",".join(map(str, counts))
    if len(counts) != num_stages:
        raise ValueError(f"--stage-layers {given} names {len(counts)} stages but {num_stages} ranks run: give one "
                         "count per rank")
    if min(counts) < 1 or sum(counts) != n:
        raise ValueError(f"--stage-layers {given}: each stage needs at least 1 decoder layer and the counts must "
                         f"sum to the {n} decoder layers of {cfg.name}")
    stages, start = [], 1
    for i, c in enumerate(counts):
        first = 0 if i == 0 else start
        stop = start + c + (1 if i == num_stages - 1 else 0)
        stages.append(Stage(i, num_stages, first, stop))
        start += c
    return stages


def balanced_counts(sizes: list, num_stages: int) -> list:
    """Decoder layers per stage minimising the largest stage's bytes (embedding on the first stage, head on the
    last; every stage at least one decoder layer). Ties go to the split with earlier stages larger."""
    emb, dec, head = sizes[0], sizes[1:-1], sizes[-1]
    n = len(dec)
    prefix = [0]
    for s in dec:
        prefix.append(prefix[-1] + s)

    def cost(stage: int, lo: int, hi: int) -> int:  # bytes of stage holding decoder layers lo..hi-1
        return prefix[hi] - prefix[lo] + (emb if stage == 0 else 0) + (head if stage == num_stages - 1 else 0)
    # best[k][j]: (largest stage bytes, counts) placing the first j decoder layers on k + 1 stages
    best = {(0, j): (cost(0, 0, j), [j]) for j in range(1, n - num_stages + 2)}
    for k in range(1, num_stages):
        for j in range(k + 1, n - num_stages + k + 2):
            options = [(max(best[k - 1, i][0], cost(k, i, j)), best[k - 1, i][1] + [j - i]) for i in range(k, j)]
            best[k, j] = min(options, key=lambda o: (o[0], [-c for c in o[1]]))
    return best[num_stages - 1, n][1]
