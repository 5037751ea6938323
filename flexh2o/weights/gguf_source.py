"""A GGUF file as a conversion source: its ModelConfig (weights/gguf_arch.py) and its tensors one at a time, under
the families' Hugging Face names, with llama.cpp's converter changes undone (q/k rows of llama, gemma's 1 + w norms)
and quantized blocks either kept (weights/blocks.py) or expanded to float32."""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Iterator, Optional, Tuple

import numpy as np
import torch

from flexh2o.compress.codec import CompressedTensor
from flexh2o.config import ModelConfig
from flexh2o.weights import blocks
from flexh2o.weights.gguf_arch import gguf_config, hf_name, undo

Source = Iterator[Tuple[str, str, Optional[str], torch.Tensor]]  # (file, source key, engine name or None, tensor)


class _Fields(Mapping):
    """A GGUF reader's metadata as key -> value, each value decoded when read (the tokenizer's arrays never are)."""

    def __init__(self, reader):
        self._fields = reader.fields

    def __getitem__(self, key):
        return self._fields[key].contents()

    def __iter__(self):
        return iter(self._fields)

    def __len__(self):
        return len(self._fields)


def gguf_source(path: str, keep_blocks: bool = False) -> Tuple[ModelConfig, Source]:
    """(ModelConfig, tensors) of the GGUF file at `path`; ValueError (one line) for a file flexh2o cannot read."""
    try:
        import gguf
    except ImportError:
        raise ValueError("converting .gguf files needs the gguf package: pip install gguf") from None
    reader = open_reader(gguf, path)
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}
    cfg = gguf_config(path, _Fields(reader), shapes)
    return cfg, _tensors(path, reader, cfg, str(reader.fields["general.architecture"].contents()), keep_blocks)


def open_reader(gguf, path: str):
    """gguf.GGUFReader(path); a file it cannot read is one ValueError line (a truncated one says so)."""
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct.error/IndexError on bad files
        text = str(e).splitlines()[0] if str(e) else repr(e)
        if "cannot reshape" in text or "buffer is smaller" in text or "mmap length" in text:
            raise ValueError(f"{path} is truncated: its tensors need more than its {os.path.getsize(path)} bytes; "
                             "copy or download the whole file again") from None
        raise ValueError(f"{path} is not a readable GGUF file: {text}") from None


def stored_dtype(path: str, keep_blocks: bool) -> str:
    """The dtype that holds every tensor of the GGUF at `path` that is not kept in its blocks without loss:
    float16 or bfloat16 when all of them are, else float32 (quantized types expand to float32)."""
    import gguf
    types = {t.tensor_type.name for t in open_reader(gguf, path).tensors
             if not (keep_blocks and blocks.keeps(t.tensor_type.name, tuple(int(x) for x in reversed(t.shape))))}
    names = {"F16": "float16", "BF16": "bfloat16"}
    return names[next(iter(types))] if len(types) == 1 and next(iter(types)) in names else "float32"


def _tensors(path: str, reader, cfg: ModelConfig, arch: str, keep_blocks: bool) -> Source:
    from gguf.quants import dequantize
    for t in reader.tensors:
        name = hf_name(arch, t.name)
        if name is None:
            continue
        shape = tuple(int(x) for x in reversed(t.shape))  # numpy row-major: (out_features, in_features)
        if keep_blocks and blocks.keeps(t.tensor_type.name, shape):
            w = blocks.from_gguf(t.data, t.tensor_type.name, shape)
        else:
            a = dequantize(t.data, t.tensor_type)  # float32
            w = torch.from_numpy(a if a.flags.writeable else np.array(a, dtype=np.float32))
        yield path, t.name, name, _undo(w, undo(arch, t.name), cfg)


def _undo(w, change: Optional[str], cfg: ModelConfig):
    if change == "rope_q":
        return _rows(w, lambda x: unpermute_rope(x, cfg.num_heads))
    if change == "rope_k":
        return _rows(w, lambda x: unpermute_rope(x, cfg.kv_heads))
    if change == "plus_one":
        return w - 1.0  # stored 1 + w in fp32; x - 1 is exact for x in [0.5, 2]
    return w


def _rows(w, fn):
    """fn (a permutation of rows) applied to a tensor, or to a CompressedTensor's data and meta alike."""
    return w.map(lambda x: fn(x).contiguous()) if isinstance(w, CompressedTensor) else fn(w)


def unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs) back to HF's rotate_half layout.

    llama.cpp stores each head's rows as (d/2, 2) pairs; HF stores them as (2, d/2) halves.
    """
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])  # (n, d/2, 2, in)
            .transpose(1, 2)  # (n, 2, d/2, in)
            .reshape(w.shape))
