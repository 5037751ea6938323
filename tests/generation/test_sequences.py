"""Sequences lays prompts out left-padded: ids (pad before the prompt) and positions (-1 on padding, then 0..)."""
from __future__ import annotations

import random

from flexh2o.generation.sequences import Sequences


def test_prompts_of_mixed_lengths_are_left_padded_with_their_positions():
    rng = random.Random(1)
    for _ in range(100):
        b, nb = rng.choice([1, 2, 3]), rng.choice([1, 2])
        prompts = [[rng.randint(0, 50) for _ in range(rng.randint(1, 9))] for _ in range(b * nb)]
        seqs = Sequences(prompts, b, nb, gen_len=3, pad_id=77, vocab=60)
        t = max(map(len, prompts))
        assert seqs.ids.shape == seqs.pos.shape == (nb, b, t)
        for i, p in enumerate(prompts):
            pad = t - len(p)
            assert seqs.ids[i // b, i % b].tolist() == [77] * pad + p
            assert seqs.pos[i // b, i % b].tolist() == [-1] * pad + list(range(len(p)))
        assert seqs.lens.flatten().tolist() == [len(p) for p in prompts]
