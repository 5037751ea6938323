"""Family: what one model family declares about itself, beside its compute (each family module's FAMILIES tuple,
gathered by models/__init__.py from every module that declares one): its name, the checkpoints it is read from
(Hugging Face model_type names and the config.json fields their conversion reads; the GGUF architecture llama.cpp
writes for it, its metadata keys, tensor names and the changes its converter made) and the ModelConfig fields every
checkpoint of it has."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional


@dataclass(frozen=True)
class Family:
    """One ModelConfig.family value and how checkpoints of it are read (weights/hf_config.py, weights/gguf_arch.py)."""

    name: str  # ModelConfig.family
    hf_model_types: tuple = ()  # config.json model_type names converted into this family
    hf_fields: Optional[tuple] = None  # the config.json fields its conversion reads (None: hf_convert reads its own)
    hf_convert: Optional[Callable] = None  # (config.json dict, name) -> ModelConfig: a family with its own reader
    hf_refused: Mapping = field(default_factory=dict)  # model_type -> why it is refused (and what to convert instead)
    hf_tied: bool = False  # tie_word_embeddings when config.json does not say
    hf_window_switch: Optional[str] = None  # a field without which config.json's sliding_window is dropped (Qwen)
    hf_layer_types: Optional[Callable] = None  # (config.json, layers) -> layer_types when it has a window but none
    hf_facts: Optional[Callable] = None  # (config.json, rope_params, rope) -> RoPE and other fields (default: rope)
    facts: Mapping = field(default_factory=dict)  # ModelConfig fields every checkpoint of the family has
    gguf_arch: Optional[str] = None  # general.architecture llama.cpp writes for it (None: no GGUF reader)
    gguf_keys: tuple = ()  # `<arch>.` metadata keys read besides weights/gguf_arch.COMMON
    gguf_tensors: Mapping = field(default_factory=dict)  # GGUF block tensor name -> HF name, over gguf_arch.BLOCK
    gguf_facts: Optional[Callable] = None  # (a, layers, hidden, heads, head_dim) -> ModelConfig fields from metadata
    gguf_undo: Mapping = field(default_factory=dict)  # GGUF tensor-name ending -> the converter's change to undo
