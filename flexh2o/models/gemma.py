"""Gemma 2 and Gemma 3 (text): Llama's attention and weight names plus the embedding scaled by sqrt(hidden),
(1 + w) RMSNorms computed in fp32, a norm after the attention and one before and after the MLP, a gelu_tanh MLP,
query_pre_attn_scalar (ModelConfig.query_scalar), alternating windowed and full layers (window, layer_kinds),
attention and final logit soft-capping (Gemma 2: attn_softcap, final_softcap); Gemma 3 adds (1 + w) q/k norms
per head (qk_norm) and its windowed layers' own RoPE base (local_rope_theta)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from flexh2o.config import ModelConfig
from flexh2o.models.common import WeightSpec, embedding, head_linear, linear, rowwise
from flexh2o.models.family import Family
from flexh2o.models.llama import HF_FIELDS, HF_WINDOWED, P, attention_specs, self_attention
from flexh2o.models.llama import layer_specs as llama_specs

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
HF_GEMMA = HF_FIELDS + HF_WINDOWED + ("query_pre_attn_scalar", "hidden_activation", "hidden_act",
                                      "final_logit_softcapping", "attn_logit_softcapping", "rope_local_base_freq")
GGUF_KEYS = ("attention.sliding_window", "final_logit_softcapping")
GGUF_TENSORS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
PLUS_ONE = {"norm.weight": "plus_one"}  # llama.cpp's converter stores every *norm.weight as 1 + w
TWENTY_SEVEN_B = {"gemma2": 46, "gemma3": 62}  # llama.cpp's layer counts of the 27B sizes
SWA_PATTERN = {"gemma2": 2, "gemma3": 6}  # llama.cpp's set_swa_pattern: layer i windowed when i % n < n - 1


def _gemma(arch: str) -> Callable:
    """What a Gemma GGUF does not carry, fixed by architecture as llama.cpp does: gemma2 windows every other layer
    (the first included), gemma3 five of every six, with RoPE base 10000 and no scaling on its windowed layers; the
    attention scale is 1/sqrt(head_dim), or 1/sqrt(hidden/heads) for the 27B sizes (their query_pre_attn_scalar)."""
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


def _hf_facts(family: str) -> Callable:
    """What a Gemma config.json adds (hf_facts): the gelu_tanh MLP checked, query_pre_attn_scalar, the soft-caps,
    RoPE (Gemma 3: per layer type in rope_parameters, or rope_local_base_freq for its windowed layers)."""
    def facts(d: dict, rope_params: Callable, rope: Callable) -> dict:
        for key in ("hidden_activation", "hidden_act"):
            if d.get(key) is not None and d[key] not in GELU_TANH:
                raise ValueError(f"{key} = {d[key]!r} is not supported (gemma's MLP is gelu_pytorch_tanh)")
        out = {"query_scalar": float(d.get("query_pre_attn_scalar") or d.get("head_dim") or 256),
               "attn_softcap": d.get("attn_logit_softcapping"), "final_softcap": d.get("final_logit_softcapping")}
        params = rope_params(d)
        if family == "gemma3" and "full_attention" in params:
            local = params.get("sliding_attention", {"rope_type": "default", "rope_theta": 10000.0})
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"rope_parameters sliding_attention = {local!r}: only default RoPE is supported "
                                 "there")
            out["local_rope_theta"] = rope(local, "rope_parameters sliding_attention")["rope_theta"]
            out.update(rope(params["full_attention"], "rope_parameters full_attention"))
        else:
            out.update(rope(params))
            if family == "gemma3":
                out["local_rope_theta"] = float(d.get("rope_local_base_freq", 10000.0))
        return out
    return facts


def _gemma2_layer_types(d: dict, n: int) -> list:
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]


def _gemma3_layer_types(d: dict, n: int) -> list:
    every = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]


FAMILIES = (  # Hugging Face's Gemma configs tie the embeddings unless they say otherwise
    Family("gemma2", hf_model_types=("gemma2",), hf_fields=HF_GEMMA, hf_tied=True,
           hf_layer_types=_gemma2_layer_types, hf_facts=_hf_facts("gemma2"), gguf_arch="gemma2",
           gguf_keys=GGUF_KEYS + ("attn_logit_softcapping",), gguf_tensors=GGUF_TENSORS, gguf_facts=_gemma("gemma2"),
           gguf_undo=PLUS_ONE),
    Family("gemma3", hf_model_types=("gemma3_text",), hf_fields=HF_GEMMA, hf_tied=True,
           hf_layer_types=_gemma3_layer_types, hf_facts=_hf_facts("gemma3"), facts={"qk_norm": True},
           hf_refused={"gemma3": "model_type 'gemma3' is the multimodal Gemma 3: convert a Gemma3ForCausalLM (text) "
                                 "checkpoint, whose model_type is gemma3_text"},
           gguf_arch="gemma3", gguf_keys=GGUF_KEYS + ("rope.freq_base_swa",), gguf_tensors=GGUF_TENSORS,
           gguf_facts=_gemma("gemma3"), gguf_undo=PLUS_ONE),
)


def layer_specs(cfg: ModelConfig) -> list:
    h, f = cfg.hidden, cfg.ffn
    specs = llama_specs(cfg)
    blocks = []
    for i in range(cfg.num_layers):
        p = f"{P}layers.{i}."
        blocks.append([WeightSpec(p + n + ".weight", (h,), "zeros") for n in NORMS] +
                      attention_specs(cfg, p + "self_attn.") +
                      [WeightSpec(p + "mlp.gate_proj.weight", (f, h)), WeightSpec(p + "mlp.up_proj.weight", (f, h)),
                       WeightSpec(p + "mlp.down_proj.weight", (h, f))])
    head = [WeightSpec(P + "norm.weight", (h,), "zeros")] + specs[-1][1:]
    return [specs[0]] + blocks + [head]


def embed(cfg: ModelConfig, w: dict, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    x = embedding(ids, w[P + "embed_tokens.weight"])
    return x * torch.tensor(cfg.hidden ** 0.5, dtype=x.dtype)


def block(cfg: ModelConfig, w: dict, i: int, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
    p = f"{P}layers.{i}."
    a = p + "self_attn."
    norm = {n: w[p + n + ".weight"] for n in NORMS}
    y = rms1(x, norm["input_layernorm"], cfg.norm_eps)
    q, k, v = (linear(y, w[a + f"{n}_proj.weight"]) for n in "qkv")
    y = self_attention(cfg, w, i, q, k, v, positions, attend, norm=rms1)
    x = x + rms1(y, norm["post_attention_layernorm"], cfg.norm_eps)
    y = rms1(x, norm["pre_feedforward_layernorm"], cfg.norm_eps)
    gate, up, down = (w[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
    y = rowwise(lambda r: linear(F.gelu(linear(r, gate), approximate="tanh") * linear(r, up), down), y, cfg.ffn)
    return x + rms1(y, norm["post_feedforward_layernorm"], cfg.norm_eps)


def head(cfg: ModelConfig, w: dict, x: torch.Tensor) -> torch.Tensor:
    x = rms1(x, w[P + "norm.weight"], cfg.norm_eps)
    out = w[P + "embed_tokens.weight"] if cfg.tie_embeddings else w["lm_head.weight"]
    logits = head_linear(x, out).float()
    if cfg.final_softcap is not None:
        logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
    return logits


def rms1(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: x / rms(x) * (1 + w), all in fp32, then x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)
