"""Prompts for a run: a JSON file of token-id lists, a text file (one prompt per line) with a tokenizer, or
FlexGen-style synthetic benchmark prompts."""
from __future__ import annotations

import os
from typing import Optional

import torch

from flexh2o.jsonfile import read_json


def synthetic_prompts(num: int, prompt_len: int, vocab: int, seed: int = 0) -> list:
    """Seeded random token ids (ids 0-3 avoided: OPT's special tokens)."""
    g = torch.Generator().manual_seed(seed + 12345)
    return torch.randint(4, vocab, (num, prompt_len), generator=g).tolist()


def load_prompts(path: str, vocab: int, tokenizer=None) -> list:
    """List of token-id lists from `path`; ValueError (one line, naming the file) when it cannot be used."""
    if not os.path.isfile(path):
        raise ValueError(f"--prompt-file {path} does not exist")
    if path.endswith(".json"):
        data = read_json(path, "a .json --prompt-file holds a list of token-id lists")
        if not isinstance(data, list) or not data or not all(
                isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                for p in data):
            raise ValueError(f"--prompt-file {path} must hold a non-empty list of non-empty lists of token ids")
        bad = [t for p in data for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"--prompt-file {path} has token id {bad[0]} outside the vocabulary (0..{vocab - 1})")
        return data
    if tokenizer is None:
        raise ValueError(f"--prompt-file {path} is text: pass --tokenizer PATH (a local tokenizer file or folder), "
                         "or give a .json list of token-id lists")
    try:
        with open(path, encoding="utf-8-sig") as f:  # a byte-order mark is not part of the first prompt
            lines = [ln.rstrip("\n") for ln in f if ln.strip()]
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                         f"{e.start}): save it as UTF-8") from None
    if not lines:
        raise ValueError(f"--prompt-file {path} has no prompts (one per line)")
    prompts = [tokenizer.encode(ln) for ln in lines]
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"--prompt-file {path}: line {i + 1} encodes to no tokens")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"--prompt-file {path}: line {i + 1} encodes to token id {bad[0]}, outside the model's "
                             f"vocabulary (0..{vocab - 1}): pass the --tokenizer of this model")
    return prompts


def fill_batch(prompts: list, num_seqs: int) -> list:
    """Repeat prompts cyclically to fill every sequence slot of the block."""
    return [prompts[i % len(prompts)] for i in range(num_seqs)]


def load_tokenizer(path: Optional[str]):
    if path is None:
        return None
    from flexh2o.tokenizer import load_tokenizer as load
    return load(path)
