"""Convert a Hugging Face checkpoint folder (safetensors or .bin, sharded or not) or a llama GGUF file into
flexh2o's checkpoint format, one tensor at a time so peak memory stays near the largest tensor."""
from __future__ import annotations

import contextlib
import glob
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Tuple

import numpy as np
import torch

from flexh2o.compress.codec import CompressedTensor
from flexh2o.config import ModelConfig
from flexh2o.weights.hf_config import from_hf_config
from flexh2o.jsonfile import read_json
from flexh2o.dtypes import parse_dtype
from flexh2o.weights import blocks
from flexh2o.weights.format import CheckpointWriter

Progress = Callable[[str, int, int], None]  # (tensor name, done, total)
Source = Iterator[Tuple[str, str, Optional[str], torch.Tensor]]  # (file, source key, engine name or None, tensor)

HF_WEIGHTS = (("model.safetensors.index.json", "model.safetensors", "model-*-of-*.safetensors"),
              ("pytorch_model.bin.index.json", "pytorch_model.bin", "pytorch_model-*.bin"))
SKIP_SUFFIXES = ("rotary_emb.inv_freq", ".masked_bias", ".attn.bias")
GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
GGUF_SKIP = ("rope_freqs.weight",)  # llama3 rope-scaling factors: refused by _gguf_config, never a weight


@dataclass(frozen=True)
class ConvertResult:
    """What convert() wrote."""

    config: ModelConfig
    num_tensors: int
    num_bytes: int
    seconds: float


def convert(src: str, dst: str, dtype: str = "float16", overwrite: bool = False,
            progress: Optional[Progress] = None, keep_blocks: bool = False) -> ConvertResult:
    """Convert SRC (HF folder or .gguf file) into a flexh2o checkpoint at DST; nothing is left at DST on error.
    keep_blocks: a GGUF's Q4_0/Q4_1/Q8_0/Q4_K tensors are kept in their own blocks (weights/blocks.py), not
    expanded into `dtype`."""
    start = time.perf_counter()
    parse_dtype(dtype)
    if os.path.isfile(src) and src.endswith(".gguf"):
        cfg, source = _gguf_source(src, keep_blocks)
    elif os.path.isdir(src):
        cfg, source = _hf_source(src)
    else:
        raise ValueError(f"{src} is neither a Hugging Face model folder nor a .gguf file")
    with CheckpointWriter(dst, cfg, dtype, overwrite) as w, contextlib.closing(source):
        total = len(w.specs)
        for path, key, name, tensor in source:
            if name is None:
                continue
            if name not in w.specs:
                raise ValueError(f"{path}: unexpected tensor {key!r} for a {cfg.family} model with this config")
            try:
                w.add(name, tensor)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
            if progress is not None:
                progress(name, len(w.entries), total)
        try:
            w.finish()
        except ValueError as e:
            raise ValueError(f"{src}: {e}") from None
    return ConvertResult(cfg, len(w.entries), w.num_bytes, time.perf_counter() - start)


# ---------------------------------------------------------------- Hugging Face folders

def _hf_source(src: str) -> Tuple[ModelConfig, Source]:
    cfg_path = os.path.join(src, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{cfg_path} is missing: SRC must be a Hugging Face model folder or a .gguf file")
    d = read_json(cfg_path, "SRC must be a complete Hugging Face model folder", dict)
    name = os.path.basename(os.path.normpath(os.path.abspath(src)))
    try:
        cfg = from_hf_config(_normalise_hf_config(d), name)
    except KeyError as e:
        raise ValueError(f"{cfg_path} lacks the field {e}") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"{cfg_path}: {e}") from None
    files = _hf_weight_files(src)
    return cfg, _hf_tensors(cfg, files)


def _normalise_hf_config(d: dict) -> dict:
    """transformers 5 writes rope_theta inside rope_parameters; lift it to where from_hf_config looks."""
    rp = d.get("rope_parameters")
    if "rope_theta" not in d and isinstance(rp, dict) and "rope_theta" in rp:
        d = {**d, "rope_theta": rp["rope_theta"]}
    return d


def _hf_weight_files(src: str) -> list:
    """The weight files of a HF folder: an index's shards, one file, or shards found by pattern."""
    for index, single, pattern in HF_WEIGHTS:
        index_path = os.path.join(src, index)
        if os.path.isfile(index_path):
            weight_map = read_json(index_path, "download the complete checkpoint", dict).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index_path} has no weight_map: download the complete checkpoint")
            shards = sorted(set(weight_map.values()))
            paths = [os.path.join(src, s) for s in shards]
            for p in paths:
                if not os.path.isfile(p):
                    raise ValueError(f"{p} is missing (listed in {index}): download the complete checkpoint")
            return paths
        if os.path.isfile(os.path.join(src, single)):
            return [os.path.join(src, single)]
        found = sorted(glob.glob(os.path.join(src, pattern)))
        if found:
            return found
    raise ValueError(f"{src} has no model.safetensors, model-*.safetensors or pytorch_model*.bin weights")


def _hf_tensors(cfg: ModelConfig, files: list) -> Source:
    for path in files:
        for key, tensor in _read_file(path):
            yield path, key, _engine_name(cfg, key), tensor


def _read_file(path: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """(key, tensor) one at a time: safetensors get_tensor per key, or a memory-mapped torch.load."""
    if path.endswith(".safetensors"):
        from safetensors import SafetensorError, safe_open
        try:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        except (OSError, SafetensorError) as e:
            raise ValueError(f"{path} is unreadable: {str(e).splitlines()[0]}") from None
        return
    state = _torch_load(path)
    for key in list(state):
        yield key, state.pop(key)


def _torch_load(path: str) -> dict:
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) files cannot be memory-mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds for bad files; all mean "unreadable"
        raise ValueError(f"{path} is unreadable: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a state dict")
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _engine_name(cfg: ModelConfig, key: str) -> Optional[str]:
    """HF state-dict key -> engine tensor name; None for buffers and tied heads."""
    if key.endswith(SKIP_SUFFIXES):
        return None
    if key == "lm_head.weight":
        return None if cfg.tie_embeddings else key
    if cfg.family == "opt" and key.startswith("decoder."):  # saved from OPTModel
        return "model." + key
    if cfg.family != "opt" and not key.startswith("model."):  # saved from LlamaModel (or another base model)
        return "model." + key
    return key


# ---------------------------------------------------------------- GGUF files

def _gguf_source(path: str, keep_blocks: bool = False) -> Tuple[ModelConfig, Source]:
    try:
        import gguf
    except ImportError:
        raise ValueError("converting .gguf files needs the gguf package: pip install gguf") from None
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct.error/IndexError on bad files
        raise ValueError(f"{path} is not a readable GGUF file: {str(e).splitlines()[0] if str(e) else e!r}") from None
    cfg = _gguf_config(path, reader)
    return cfg, _gguf_tensors(path, reader, cfg, keep_blocks)


def _gguf_config(path: str, reader) -> ModelConfig:
    """ModelConfig from GGUF metadata (llama architecture only)."""
    def get(key, default=KeyError):
        f = reader.fields.get(key)
        if f is None:
            if default is KeyError:
                raise ValueError(f"{path} lacks the GGUF metadata key {key!r}")
            return default
        return f.contents()

    arch = get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported: flexh2o converts llama GGUF files")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path} has no token_embd.weight tensor")
    hidden, heads = int(get("llama.embedding_length")), int(get("llama.attention.head_count"))
    if int(get("llama.attention.key_length", hidden // heads)) != hidden // heads:
        raise ValueError(f"{path}: head size differs from hidden/heads, which flexh2o does not support")
    eos = get("tokenizer.ggml.eos_token_id", 2)
    scaling = str(get("llama.rope.scaling.type", "none"))
    if "rope_freqs.weight" in tensors or scaling not in ("none", "linear"):
        what = "rope_freqs.weight (Llama 3.1 rope scaling)" if "rope_freqs.weight" in tensors else scaling
        raise ValueError(f"{path}: GGUF rope scaling {what} is not read from GGUF files: convert the model's "
                         "Hugging Face folder instead (flexh2o-convert FOLDER NAME reads its rope_scaling)")
    linear = ({"rope_type": "linear", "rope_factor": float(get("llama.rope.scaling.factor"))}
              if scaling == "linear" else {})
    return ModelConfig(
        name=os.path.splitext(os.path.basename(path))[0], family="llama", hidden=hidden,
        num_layers=int(get("llama.block_count")), num_heads=heads,
        num_kv_heads=int(get("llama.attention.head_count_kv", heads)), ffn=int(get("llama.feed_forward_length")),
        vocab=int(get("llama.vocab_size", int(tensors["token_embd.weight"].shape[-1]))),
        max_positions=int(get("llama.context_length", 2048)),
        norm_eps=float(get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("llama.rope.freq_base", 10000.0)), tie_embeddings="output.weight" not in tensors,
        pad_token_id=int(get("tokenizer.ggml.padding_token_id", 0)),
        bos_token_id=int(get("tokenizer.ggml.bos_token_id", 1)), eos_token_id=int(eos), **linear)


def _gguf_tensors(path: str, reader, cfg: ModelConfig, keep_blocks: bool = False) -> Source:
    from gguf.quants import dequantize
    for t in reader.tensors:
        name = _gguf_name(t.name)
        if name is None:
            continue
        shape = tuple(int(x) for x in reversed(t.shape))  # numpy row-major: (out_features, in_features)
        if keep_blocks and blocks.keeps(t.tensor_type.name, shape):
            w = blocks.from_gguf(t.data, t.tensor_type.name, shape)
        else:
            a = dequantize(t.data, t.tensor_type)  # float32
            w = torch.from_numpy(a if a.flags.writeable else np.array(a, dtype=np.float32))
        if t.name.endswith("attn_q.weight"):
            w = _rows(w, lambda x: unpermute_rope(x, cfg.num_heads))
        elif t.name.endswith("attn_k.weight"):
            w = _rows(w, lambda x: unpermute_rope(x, cfg.kv_heads))
        yield path, t.name, name, w


def _rows(w, fn):
    """fn (a permutation of rows) applied to a tensor, or to a CompressedTensor's data and meta alike."""
    return w.map(lambda x: fn(x).contiguous()) if isinstance(w, CompressedTensor) else fn(w)


def _gguf_name(gname: str) -> Optional[str]:
    """GGUF tensor name -> HF Llama name; None for tensors the engine does not use."""
    if gname in GGUF_SKIP:
        return None
    base, _, suffix = gname.rpartition(".")
    if base in GGUF_TOP:
        return f"{GGUF_TOP[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in GGUF_BLOCK:
        return f"model.layers.{parts[1]}.{GGUF_BLOCK[parts[2]]}.{suffix}"
    return gname  # unknown: convert() reports it as unexpected


def unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs) back to HF's rotate_half layout.

    llama.cpp stores each head's rows as (d/2, 2) pairs; HF stores them as (2, d/2) halves.
    """
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])  # (n, d/2, 2, in)
            .transpose(1, 2)  # (n, 2, d/2, in)
            .reshape(w.shape))
