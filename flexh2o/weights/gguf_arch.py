"""What a GGUF file means, per llama.cpp architecture (the gguf_arch each family declares, flexh2o/models/: llama,
qwen2, qwen3, phi3, gemma2, gemma3): its metadata -> ModelConfig, its tensor names -> the Hugging Face names the
families use, and the changes llama.cpp's convert_hf_to_gguf.py made to a tensor, undone.

Facts from llama.cpp (convert_hf_to_gguf.py writes the file, src/llama-model.cpp reads it), each declared by its
family (models/family.py: gguf_keys, gguf_tensors, gguf_facts, gguf_undo): only the llama architecture (Llama,
Mistral) has its q/k rows permuted for interleaved RoPE (the others keep Hugging Face's rotate-half layout: llama.cpp
runs them with NEOX RoPE); Gemma 2/3 norms are stored as 1 + w; phi3 keeps its fused tensors; what the file does
not carry, llama.cpp fixes by architecture, and so does each family's gguf_facts.
Every key under `<arch>.` is read, checked to hold a value that changes nothing, or refused in one line (READ)."""
from __future__ import annotations

import os
from typing import Callable, Optional

from flexh2o.config import ModelConfig
from flexh2o.models import by_gguf_arch, families

COMMON = ("context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
          "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
          "attention.key_length", "attention.value_length", "rope.dimension_count", "rope.freq_base",
          "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
          "rope.scaling.finetuned")
# arch: the `<arch>.` keys its conversion reads (any other key under `<arch>.` is refused); a view of the families'
# declarations (the conversion itself asks by_gguf_arch)
READ = {f.gguf_arch: COMMON + f.gguf_keys for f in families() if f.gguf_arch is not None}
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
SKIP = ("rope_freqs.weight",)  # llama3 rope-scaling factors: refused by gguf_config, never a weight
REFUSED_TENSORS = {"rope_freqs.weight": "rope scaling rope_freqs.weight (Llama 3.1 rope scaling)",
                   "rope_factors_long.weight": "rope scaling rope_factors_long.weight (Phi-3 longrope)",
                   "rope_factors_short.weight": "rope scaling rope_factors_short.weight (Phi-3 longrope)"}


def gguf_config(path: str, fields: dict, tensors: dict) -> ModelConfig:
    """ModelConfig of a GGUF file from its metadata `fields` (key -> value) and `tensors` (name -> shape)."""
    def get(key, default=KeyError):
        if key not in fields:
            if default is KeyError:
                raise ValueError(f"{path} lacks the GGUF metadata key {key!r}")
            return default
        return fields[key]

    arch = get("general.architecture")
    fam = by_gguf_arch(arch)
    if fam is None:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported: flexh2o converts "
                         f"{', '.join(f.gguf_arch for f in families() if f.gguf_arch is not None)} GGUF files")
    _check_keys(path, arch, fields, tensors)
    a = lambda key, default=KeyError: get(f"{arch}.{key}", default)  # noqa: E731
    hidden, heads = int(a("embedding_length")), int(a("attention.head_count"))
    head_dim = int(a("attention.key_length", hidden // heads))
    _require(path, f"{arch}.attention.value_length", a("attention.value_length", head_dim), (head_dim,))
    _require(path, f"{arch}.rope.dimension_count", a("rope.dimension_count", head_dim), (head_dim,))
    layers = int(a("block_count"))
    kw = dict(name=os.path.splitext(os.path.basename(path))[0], family=fam.name, hidden=hidden, num_layers=layers,
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
    kw.update(fam.facts)
    if fam.gguf_facts is not None:
        kw.update(fam.gguf_facts(a, layers, hidden, heads, head_dim))
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
        if key.startswith(arch + ".") and key[len(arch) + 1:] not in COMMON + by_gguf_arch(arch).gguf_keys:
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


def hf_name(arch: str, gname: str) -> Optional[str]:
    """GGUF tensor name -> the family's Hugging Face name; None for tensors the engine does not use; the name itself
    when unknown (convert() reports it as unexpected)."""
    if gname in SKIP:
        return None
    base, _, suffix = gname.rpartition(".")
    if base in TOP:
        return f"{TOP[base]}.{suffix}"
    parts = base.split(".")
    block = {**BLOCK, **by_gguf_arch(arch).gguf_tensors}
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block:
        return f"model.layers.{parts[1]}.{block[parts[2]]}.{suffix}"
    return gname


def undo(arch: str, gname: str) -> Optional[str]:
    """Which change llama.cpp's converter made to tensor `gname`: "rope_q" / "rope_k" (rows permuted, llama only),
    "plus_one" (a gemma norm stored as 1 + w), or None (the family's gguf_undo, by the name's ending)."""
    return next((change for end, change in by_gguf_arch(arch).gguf_undo.items() if gname.endswith(end)), None)
