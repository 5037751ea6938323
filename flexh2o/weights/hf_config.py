"""Hugging Face config.json -> ModelConfig, per model type. Every field is read, or checked to change nothing, or
listed as inert (flexh2o/weights/hf_fields.py); anything else is refused in one line naming the field and its value."""
from __future__ import annotations

from flexh2o.config import ModelConfig
from flexh2o.models import Family, by_hf_model_type, families
from flexh2o.weights.hf_fields import check_fields, check_rope


def from_hf_config(d: dict, name: str = "converted") -> ModelConfig:
    """Hugging Face config.json (of a model_type a family declares, flexh2o/models/) -> ModelConfig."""
    mt = d.get("model_type", "")
    fam = by_hf_model_type(mt)
    if fam is not None and fam.hf_convert is not None:
        return fam.hf_convert(d, name)
    refused = next((f.hf_refused[mt] for f in families() if mt in f.hf_refused), None)
    if refused:
        raise ValueError(refused)
    if fam is None:
        raise ValueError(f"unsupported model_type {mt!r} in config.json: flexh2o supports "
                         f"{', '.join(t for f in families() for t in f.hf_model_types)}")
    check_fields(d)
    kw = dict(name=name, family=fam.name, hidden=d["hidden_size"], num_layers=d["num_hidden_layers"],
              num_heads=d["num_attention_heads"], num_kv_heads=d.get("num_key_value_heads"),
              ffn=d["intermediate_size"], vocab=d["vocab_size"],
              max_positions=d.get("max_position_embeddings", 2048), norm_eps=d.get("rms_norm_eps", 1e-6),
              tie_embeddings=d.get("tie_word_embeddings", fam.hf_tied),
              pad_token_id=_or(d.get("pad_token_id"), 0), bos_token_id=_or(d.get("bos_token_id"), 1),
              eos_token_id=_or(_first(d.get("eos_token_id")), 2))
    hd = d.get("head_dim")
    if hd and hd != d["hidden_size"] // d["num_attention_heads"]:
        kw["head_size"] = hd
    kw.update(_window(d, fam))
    kw.update(fam.hf_facts(d, _rope_params, _rope) if fam.hf_facts else _rope(_rope_params(d)))
    kw.update(fam.facts)
    return ModelConfig(**kw)


def _rope_params(d: dict) -> dict:
    """transformers 5 writes rope_parameters ({rope_type, rope_theta, ...}); older files rope_scaling + rope_theta."""
    params = d.get("rope_parameters")
    if params is not None and d.get("rope_scaling"):
        raise ValueError(f"rope_scaling = {d['rope_scaling']!r} beside rope_parameters: keep one of them")
    if params is None:
        params = {**(d.get("rope_scaling") or {}), "rope_theta": d.get("rope_theta", 10000.0)}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters = {params!r} must be a mapping")
    return params


def _rope(params: dict, where: str = "rope_parameters") -> dict:
    """ModelConfig's rope fields from one rope_parameters mapping (refused when it asks for more)."""
    check_rope(params, where)
    kind = params.get("rope_type", params.get("type", "default"))
    out = {"rope_theta": float(params.get("rope_theta", 10000.0)), "rope_type": kind}
    if kind in ("linear", "llama3"):
        out["rope_factor"] = float(params["factor"])
    if kind == "llama3":
        out.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                   rope_high_freq_factor=float(params["high_freq_factor"]),
                   rope_original_max=int(params["original_max_position_embeddings"]))
    return out


def _window(d: dict, fam: Family) -> dict:
    """sliding_window and which layers it covers (layer_types, or each family's own default rule)."""
    window = d.get("sliding_window")
    if fam.hf_window_switch and not d.get(fam.hf_window_switch, False):
        window = None  # transformers' Qwen configs drop the window unless use_sliding_window
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types is None:
        types = _default_layer_types(d, fam, n, window)
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types = {types!r}: expected {n} entries of sliding_attention / full_attention")
    if window is None:
        if "sliding_attention" in types and not fam.hf_window_switch:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is null")
        return {}
    kinds = "".join("s" if t == "sliding_attention" else "f" for t in types)
    return {"sliding_window": int(window), "layer_kinds": "" if set(kinds) == {"s"} else kinds}


def _default_layer_types(d: dict, fam: Family, n: int, window) -> list:
    if window is None:
        return ["full_attention"] * n
    if fam.hf_layer_types is not None:
        return fam.hf_layer_types(d, n)
    return ["sliding_attention"] * n


def _first(x):
    return x[0] if isinstance(x, list) else x


def _or(x, default):
    return default if x is None else x
