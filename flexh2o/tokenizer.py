"""Tokenizers for evaluation, never from a hub: a local tokenizer.json (file or folder) or a GGUF file's metadata.

Needs the `tokenizers` package (the [eval] extra); it is imported only when a tokenizer is loaded.
GGUF: byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`, as in SmolLM2, Llama 3, Qwen) are built
directly from tokenizer.ggml.tokens / merges / token_type; other kinds go through transformers' GGUF converter.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any, Optional

# llama.cpp pre-tokenizers that split every digit on its own before the GPT-2 regex
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell")
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types


@dataclass
class Tokenizer:
    """A `tokenizers.Tokenizer` plus the ids the evaluation needs."""

    backend: Any
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    add_bos: bool = False

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, bos: Optional[bool] = None) -> list:
        """Token ids of `text`; a BOS id first when `bos` (default: the model's add_bos setting)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if bos is None else bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)


def load_tokenizer(path: str) -> Tokenizer:
    """tokenizer.json file, a folder holding tokenizer.json or one .gguf file, or a .gguf file."""
    if os.path.isdir(path):
        tj = os.path.join(path, "tokenizer.json")
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if os.path.isfile(tj):
            return from_tokenizer_json(tj)
        if len(ggufs) == 1:
            return from_gguf(ggufs[0])
        raise ValueError(f"{path} holds no tokenizer.json and {len(ggufs)} .gguf files: give the file itself")
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer {path} does not exist: give a tokenizer.json, a .gguf file or their folder")
    if path.endswith(".gguf"):
        return from_gguf(path)
    return from_tokenizer_json(path)


def from_tokenizer_json(path: str) -> Tokenizer:
    tk = _tokenizers()
    try:
        backend = tk.Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"{path} is not a readable tokenizer.json: {str(e).splitlines()[0]}") from None
    cfg = _sibling_config(path)
    return Tokenizer(backend, cfg.get("bos_token_id"), _first(cfg.get("eos_token_id")),
                     bool(cfg.get("add_bos_token", False)))


def from_gguf(path: str) -> Tokenizer:
    """Byte-level BPE from GGUF metadata; other vocabularies through transformers (offline)."""
    try:
        import gguf
    except ImportError:
        raise ValueError("reading a tokenizer from a .gguf file needs the gguf package: pip install gguf") from None
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises several kinds on bad files
        raise ValueError(f"{path} is not a readable GGUF file: {str(e).splitlines()[0] if str(e) else e!r}") from None

    def get(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    kind = get("tokenizer.ggml.model")
    if kind is None:
        raise ValueError(f"{path} carries no tokenizer (no tokenizer.ggml.model metadata)")
    if kind == "gpt2":
        backend = _byte_level_bpe(get("tokenizer.ggml.tokens"), get("tokenizer.ggml.merges", []),
                                  get("tokenizer.ggml.token_type"), get("tokenizer.ggml.pre", "default"),
                                  bool(get("tokenizer.ggml.add_space_prefix", False)))
    else:
        backend = _via_transformers(path, kind)
    bos, eos = get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")
    return Tokenizer(backend, None if bos is None else int(bos), None if eos is None else int(eos),
                     bool(get("tokenizer.ggml.add_bos_token", False)))


def _byte_level_bpe(tokens: list, merges: list, types: Optional[list], pre: str, prefix_space: bool):
    tk = _tokenizers()
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tk.Tokenizer(tk.models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=prefix_space, use_regex=True)
    if pre in DIGIT_SPLIT_PRE:
        byte_level = tk.pre_tokenizers.Sequence([tk.pre_tokenizers.Digits(individual_digits=True), byte_level])
    backend.pre_tokenizer = byte_level
    backend.decoder = tk.decoders.ByteLevel()
    if types is not None:
        added = [tk.AddedToken(tokens[i], special=t == CONTROL, normalized=False)
                 for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
        backend.add_tokens(added)  # ids already in the vocabulary, so they keep them
    return backend


def _via_transformers(path: str, kind: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                            gguf_file=os.path.basename(path))
    except ImportError:
        raise ValueError(f"{path} has a {kind!r} tokenizer, which needs transformers to convert") from None
    except Exception as e:  # transformers raises many kinds for unsupported files
        raise ValueError(f"{path}: cannot build its {kind!r} tokenizer: {str(e).splitlines()[0]}") from None
    if not hasattr(tok, "backend_tokenizer"):
        raise ValueError(f"{path}: transformers gave a slow tokenizer for {kind!r}; a fast one is needed")
    return tok.backend_tokenizer


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ValueError("loading a tokenizer needs the tokenizers package: pip install 'flexh2o[eval]'") from None
    return tokenizers


def _sibling_config(path: str) -> dict:
    """bos/eos ids from a config.json or generation_config.json beside tokenizer.json, if any, and add_bos_token
    (which flexh2o-convert writes there for a checkpoint converted from a GGUF: weights/run_files.py)."""
    import json
    out: dict = {}
    for name in ("config.json", "generation_config.json"):
        f = os.path.join(os.path.dirname(os.path.abspath(path)), name)
        try:
            with open(f) as fh:
                d = json.load(fh)
        except (OSError, ValueError):
            continue
        out.update({k: d[k] for k in ("bos_token_id", "eos_token_id", "add_bos_token") if d.get(k) is not None})
    return out


def _first(x):
    return x[0] if isinstance(x, list) else x
