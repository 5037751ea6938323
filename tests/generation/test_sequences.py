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


def test_emit_keeps_fp32_logits_uncopied_and_converts_the_others_into_one_record():
    """Contiguous fp32 logits on the CPU are the record as they came (no copy); 16-bit ones and strided views are
    converted into one held fp32 record per GPU batch, reused every step; the sampler sees the same values either
    way, and last_logits / step_logits hold each step's (zeros for a batch that emitted none)."""
    import torch

    b, nb, vocab = 2, 2, 50
    seqs = Sequences([[1, 2], [3], [4, 5], [6]], b, nb, gen_len=3, pad_id=0, vocab=vocab, record_logits=True)
    seen = []

    def sampler(logits, step, rows):
        seen.append(logits)
        return logits.argmax(-1)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, vocab, generator=g)
    seqs.emit(0, 0, x, sampler)
    assert seen[-1] is x and seqs._last[0] is x  # not copied
    assert torch.equal(seqs.last_logits, torch.stack([x, torch.zeros(b, vocab)]))
    held = []
    for step, y in enumerate([torch.randn(b, vocab, generator=g).bfloat16(), torch.randn(vocab, b, generator=g).t()]):
        seqs.emit(step + 1, 1, y, sampler)
        assert seen[-1].dtype == torch.float32 and seen[-1].is_contiguous() and torch.equal(seen[-1], y.float())
        held.append(seen[-1].data_ptr())
        assert torch.equal(seqs.step_logits[step + 1][1], y.float())
    assert held[0] == held[1]  # one record, reused
    assert torch.equal(seqs.last_logits[1], y) and torch.equal(seqs.step_logits[0][0], x)
    assert seqs.tokens[1, :, 2].tolist() == y.argmax(-1).tolist()
