"""What a GGUF file means, per llama.cpp architecture (llama, qwen2, qwen3, phi3, gemma2, gemma3): its metadata ->
ModelConfig, its tensor names -> the Hugging Face names the families use, and the changes llama.cpp's
convert_hf_to_gguf.py made to a tensor, undone.

Facts from llama.cpp (convert_hf_to_gguf.py writes the file, src/llama-model.cpp reads it):
- Only the llama architecture (Llama, Mistral) has its q/k rows permuted for interleaved RoPE; qwen2, qwen3, phi3
  and the gemmas keep Hugging Face's rotate-half layout (llama.cpp runs them with NEOX RoPE).
- Gemma 2/3 norms are stored as 1 + w (the converter adds 1 to every `*norm.weight`); subtracted here.
- phi3 keeps the fused qkv (attn_qkv) and gate_up (ffn_up) tensors as Hugging Face has them.
- What the file does not carry, llama.cpp fixes by architecture, and so does this module: gemma2 windows every other
  layer (the first included), gemma3 five of every six, with RoPE base 10000 and no scaling on its windowed layers;
  the attention scale is 1/sqrt(head_dim), or 1/sqrt(hidden/heads) for the 27B sizes (46 layers for gemma2, 62 for
  gemma3: their query_pre_attn_scalar).
Every key under `<arch>.` is read, checked to hold a value that changes nothing, or refused in one line (READ)."""
from __future__ import annotations

import os
from typing import Callable, Optional

from flexh2o.config import ModelConfig

COMMON = ("context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
          "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
          "attention.key_length", "attention.value_length", "rope.dimension_count", "rope.freq_base",
          "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
          "rope.scaling.finetuned")
READ = {  # arch: the `<arch>.` keys its conversion reads (any other key under `<arch>.` is refused)
    "llama": COMMON + ("attention.sliding_window",),
    "qwen2": COMMON, "qwen3": COMMON,
    "phi3": COMMON + ("attention.sliding_window",),
    "gemma2": COMMON + ("attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping"),
    "gemma3": COMMON + ("attention.sliding_window", "final_logit_softcapping", "rope.freq_base_swa"),
}
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
BLOCK_BY_ARCH = {
    "phi3": {**BLOCK, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": {**BLOCK, "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
BLOCK_BY_ARCH["gemma3"] = BLOCK_BY_ARCH["gemma2"]
SKIP = ("rope_freqs.weight",)  # llama3 rope-scaling factors: refused by gguf_config, never a weight
REFUSED_TENSORS = {"rope_freqs.weight": "rope scaling rope_freqs.weight (Llama 3.1 rope scaling)",
                   "rope_factors_long.weight": "rope scaling rope_factors_long.weight (Phi-3 longrope)",
                   "rope_factors_short.weight": "rope scaling rope_factors_short.weight (Phi-3 longrope)"}
TWENTY_SEVEN_B = {"gemma2": 46, "gemma3": 62}  # llama.cpp's layer counts of the 27B sizes
SWA_PATTERN = {"gemma2": 2, "gemma3": 6}  # llama.cpp's set_swa_pattern: layer i windowed when i % n < n - 1


def gguf_config(path: str, fields: dict, tensors: dict) -> ModelConfig:
    """ModelConfig of a GGUF file from its metadata `fields` (key -> value) and `tensors` (name -> shape)."""
    def get(key, default=KeyError):
        if key not in fields:
            if default is KeyError:
                raise ValueError(f"{path} lacks the GGUF metadata key {key!r}")
            return default
        return fields[key]

    arch = get("general.architecture")
    if arch not in READ:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported: flexh2o converts "
                         f"{', '.join(READ)} GGUF files")
    _check_keys(path, arch, fields, tensors)
    a = lambda key, default=KeyError: get(f"{arch}.{key}", default)  # noqa: E731
    hidden, heads = int(a("embedding_length")), int(a("attention.head_count"))
    head_dim = int(a("attention.key_length", hidden // heads))
    _require(path, f"{arch}.attention.value_length", a("attention.value_length", head_dim), (head_dim,))
    _require(path, f"{arch}.rope.dimension_count", a("rope.dimension_count", head_dim), (head_dim,))
    layers = int(a("block_count"))
    kw = dict(name=os.path.splitext(os.path.basename(path))[0], family=arch, hidden=hidden, num_layers=layers,
              num_heads=heads, num_kv_heads=int(a("attention.head_count_kv", heads)),
              ffn=int(a("feed_forward_length")), vocab=int(a("vocab_size", tensors["token_embd.weight"][0])),
              max_positions=int(a("context_length", 2048)),
              norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
              rope_theta=float(a("rope.freq_base", 10000.0)), tie_embeddings="output.weight" not in tensors,
              pad_token_id=int(get("tokenizer.ggml.padding_token_id", 0)),
              bos_token_id=int(get("tokenizer.ggml.bos_token_id", 1)),
              eos_token_id=int(get("tokenizer.ggml.eos_token_id", 2)))
    if head_dim != hidden // heads:
        kw["head_size"] = head_dim
    kw.update(_rope_scaling(path, arch, a))
    kw.update(ARCH_FACTS[arch](a, layers, hidden, heads, head_dim))
    return ModelConfig(**kw)


def _check_keys(path: str, arch: str, fields: dict, tensors: dict) -> None:
    for name, what in REFUSED_TENSORS.items():
        if name in tensors:
            raise ValueError(f"{path}: GGUF {what} is not read from GGUF files: convert the model's Hugging Face "
                             "folder instead (flexh2o-convert FOLDER NAME reads its rope_scaling)")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path} has no token_embd.weight tensor")
    for key in fields:
        if key.startswith("split."):
            raise ValueError(f"{path} is one part of a split GGUF ({key}): merge it first "
                             "(llama-gguf-split --merge FIRST-PART OUT.gguf)")
        if key.startswith(arch + ".") and key[len(arch) + 1:] not in READ[arch]:
            raise ValueError(f"{path}: GGUF metadata key {key} = {_short(fields[key])} changes the computation "
                             f"and flexh2o does not implement it for {arch} GGUF files")


def _rope_scaling(path: str, arch: str, a: Callable) -> dict:
    scaling = str(a("rope.scaling.type", "none"))
    if scaling not in ("none", "linear"):
        raise ValueError(f"{path}: GGUF rope scaling {scaling} is not read from GGUF files: convert the model's "
                         "Hugging Face folder instead (flexh2o-convert FOLDER NAME reads its rope_scaling)")
    if scaling == "none":
        return {}
    return {"rope_type": "linear", "rope_factor": float(a("rope.scaling.factor"))}


def _require(path: str, key: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{path}: GGUF metadata key {key} = {_short(value)} is not supported (flexh2o needs "
                         f"{' or '.join(map(str, allowed))} here)")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _windowed(a: Callable) -> dict:
    """llama (Mistral) and phi3: `attention.sliding_window` windows every layer, as Hugging Face's config does
    (llama.cpp itself turns phi3's window off)."""
    window = a("attention.sliding_window", 0)
    return {"sliding_window": int(window)} if window else {}


def _gemma(arch: str) -> Callable:
    def facts(a: Callable, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        out = {"query_scalar": float(hidden // heads if layers == TWENTY_SEVEN_B[arch] else head_dim),
               "final_softcap": _softcap(a("final_logit_softcapping", None))}
        if arch == "gemma2":
            out["attn_softcap"] = _softcap(a("attn_logit_softcapping", None))
        window = int(a("attention.sliding_window", 0))
        if window:
            n = SWA_PATTERN[arch]
            kinds = "".join("s" if i % n < n - 1 else "f" for i in range(layers))
            out.update(sliding_window=window, layer_kinds="" if set(kinds) == {"s"} else kinds)
            if arch == "gemma3":
                out["local_rope_theta"] = float(a("rope.freq_base_swa", 10000.0))
        return out
    return facts


def _softcap(value) -> Optional[float]:
    return float(value) if value else None


ARCH_FACTS = {
    "llama": lambda a, *_: {**_windowed(a), **({"family": "mistral"} if _windowed(a) else {})},
    "qwen2": lambda a, *_: {"attn_bias": True},
    "qwen3": lambda a, *_: {"qk_norm": True},
    "phi3": lambda a, *_: _windowed(a),
    "gemma2": _gemma("gemma2"),
    "gemma3": lambda *args: {**_gemma("gemma3")(*args), "qk_norm": True},
}


def hf_name(arch: str, gname: str) -> Optional[str]:
    """GGUF tensor name -> the family's Hugging Face name; None for tensors the engine does not use; the name itself
    when unknown (convert() reports it as unexpected)."""
    if gname in SKIP:
        return None
    base, _, suffix = gname.rpartition(".")
    if base in TOP:
        return f"{TOP[base]}.{suffix}"
    parts = base.split(".")
    block = BLOCK_BY_ARCH.get(arch, BLOCK)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block:
        return f"model.layers.{parts[1]}.{block[parts[2]]}.{suffix}"
    return gname


def undo(arch: str, gname: str) -> Optional[str]:
    """Which change llama.cpp's converter made to tensor `gname`: "rope_q" / "rope_k" (rows permuted, llama only),
    "plus_one" (a gemma norm stored as 1 + w), or None."""
    if arch == "llama" and gname.endswith("attn_q.weight"):
        return "rope_q"
    if arch == "llama" and gname.endswith("attn_k.weight"):
        return "rope_k"
    if arch.startswith("gemma") and gname.endswith("norm.weight"):
        return "plus_one"
    return None
