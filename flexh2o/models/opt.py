"""OPT (all sizes, opt-350m's post-LayerNorm and project_in/out included): weight specs and layer compute."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flexh2o.config import ModelConfig
from flexh2o.models.common import (WeightSpec, embedding, head_linear, linear, linear_add, linear_relu, merge_heads,
                                   rowwise, split_heads)
from flexh2o.models.family import Family

POS_OFFSET = 2  # OPT's learned position table starts at index 2
P = "model.decoder."


def from_hf(d: dict, name: str) -> ModelConfig:
    """An OPT config.json -> ModelConfig."""
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


FAMILIES = (Family("opt", hf_model_types=("opt",), hf_convert=from_hf),)  # no GGUF reader


def layer_specs(cfg: ModelConfig) -> list:
    h, e = cfg.hidden, cfg.embed_dim
    embed = [WeightSpec(P + "embed_tokens.weight", (cfg.vocab, e)),
             WeightSpec(P + "embed_positions.weight", (cfg.max_positions + POS_OFFSET, h))]
    head = [WeightSpec(P + "embed_tokens.weight", (cfg.vocab, e))]
    if e != h:
        embed.append(WeightSpec(P + "project_in.weight", (h, e)))
        head.insert(0, WeightSpec(P + "project_out.weight", (e, h)))
    if cfg.norm_before:
        head[:0] = [WeightSpec(P + "final_layer_norm.weight", (h,), "ones"),
                    WeightSpec(P + "final_layer_norm.bias", (h,), "zeros")]
    return [embed] + [_block_specs(cfg, i) for i in range(cfg.num_layers)] + [head]


def _block_specs(cfg: ModelConfig, i: int) -> list:
    h, f = cfg.hidden, cfg.ffn
    p = f"{P}layers.{i}."
    specs = []
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        specs += [WeightSpec(f"{p}self_attn.{proj}.weight", (h, h)),
                  WeightSpec(f"{p}self_attn.{proj}.bias", (h,), "zeros")]
    for ln in ("self_attn_layer_norm", "final_layer_norm"):
        specs += [WeightSpec(f"{p}{ln}.weight", (h,), "ones"), WeightSpec(f"{p}{ln}.bias", (h,), "zeros")]
    specs += [WeightSpec(f"{p}fc1.weight", (f, h)), WeightSpec(f"{p}fc1.bias", (f,), "zeros"),
              WeightSpec(f"{p}fc2.weight", (h, f)), WeightSpec(f"{p}fc2.bias", (h,), "zeros")]
    return specs


def embed(cfg: ModelConfig, w: dict, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """ids, positions (b, t) -> hidden (b, t, h). Pad positions may be anything >= 0."""
    x = embedding(ids, w[P + "embed_tokens.weight"])  # (b, t, e)
    if cfg.embed_dim != cfg.hidden:
        x = linear(x, w[P + "project_in.weight"])  # (b, t, h)
    return x + embedding(positions + POS_OFFSET, w[P + "embed_positions.weight"])


def block(cfg: ModelConfig, w: dict, i: int, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
    """One decoder layer. attend(q, k, v) -> (b, heads, t, d) owns the cache and the KV policy."""
    p = f"{P}layers.{i}."
    a = p + "self_attn."
    ln1 = (w[p + "self_attn_layer_norm.weight"], w[p + "self_attn_layer_norm.bias"])
    ln2 = (w[p + "final_layer_norm.weight"], w[p + "final_layer_norm.bias"])
    y = _ln(x, ln1) if cfg.norm_before else x
    q = split_heads(linear(y, w[a + "q_proj.weight"], w[a + "q_proj.bias"]), cfg.num_heads)  # (b, n, t, d)
    k = split_heads(linear(y, w[a + "k_proj.weight"], w[a + "k_proj.bias"]), cfg.num_heads)
    v = split_heads(linear(y, w[a + "v_proj.weight"], w[a + "v_proj.bias"]), cfg.num_heads)
    o = merge_heads(attend(q, k, v))  # (b, t, h)
    x = linear_add(o, w[a + "out_proj.weight"], w[a + "out_proj.bias"], x)  # x + o @ W.T + b
    if not cfg.norm_before:
        x = _ln(x, ln1)
    y = _ln(x, ln2) if cfg.norm_before else x
    fc1, fc2 = (w[p + "fc1.weight"], w[p + "fc1.bias"]), (w[p + "fc2.weight"], w[p + "fc2.bias"])
    x = rowwise(lambda r, res: linear_add(linear_relu(r, *fc1), *fc2, res), y, cfg.ffn, x)  # x + fc2(relu(fc1(y)))
    return x if cfg.norm_before else _ln(x, ln2)


def head(cfg: ModelConfig, w: dict, x: torch.Tensor) -> torch.Tensor:
    """hidden (b, t, h) -> logits (b, t, vocab) in the compute dtype (Sequences.emit converts them into its held
    fp32 record: a 16-bit step's 128 x 50272 logits converted into a fresh fp32 tensor took 7-12 ms of page faults
    on a Zen 4 VM)."""
    if cfg.norm_before:
        x = _ln(x, (w[P + "final_layer_norm.weight"], w[P + "final_layer_norm.bias"]))
    if cfg.embed_dim != cfg.hidden:
        x = linear(x, w[P + "project_out.weight"])
    return head_linear(x, w[P + "embed_tokens.weight"])


def _ln(x: torch.Tensor, wb) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), wb[0], wb[1], 1e-5)
