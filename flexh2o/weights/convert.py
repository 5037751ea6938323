"""Convert a Hugging Face checkpoint folder (safetensors or .bin, sharded or not) or a GGUF file into
flexh2o's checkpoint format, one tensor at a time so peak memory stays near the largest tensor."""
from __future__ import annotations

import contextlib
import glob
import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Tuple

import torch

from flexh2o.config import ModelConfig
from flexh2o.weights.hf_config import from_hf_config
from flexh2o.jsonfile import read_json
from flexh2o.dtypes import dtype_name, parse_dtype
from flexh2o.weights.gguf_source import gguf_source, stored_dtype, unpermute_rope  # noqa: F401  (importable here)
from flexh2o.weights.run_files import write_run_files
from flexh2o.weights.format import CheckpointWriter

Progress = Callable[[str, int, int], None]  # (tensor name, done, total)
Source = Iterator[Tuple[str, str, Optional[str], torch.Tensor]]  # (file, source key, engine name or None, tensor)

HF_WEIGHTS = (("model.safetensors.index.json", "model.safetensors", "model-*-of-*.safetensors"),
              ("pytorch_model.bin.index.json", "pytorch_model.bin", "pytorch_model-*.bin"))
SKIP_SUFFIXES = ("rotary_emb.inv_freq", ".masked_bias", ".attn.bias")


@dataclass(frozen=True)
class ConvertResult:
    """What convert() wrote."""

    config: ModelConfig
    num_tensors: int
    num_bytes: int
    seconds: float
    dtype: str = "float32"  # the stored dtype of the tensors not kept in blocks
    kept: tuple = ()  # what weights/run_files.py kept beside the weights


def convert(src: str, dst: str, dtype: str = "auto", overwrite: bool = False,
            progress: Optional[Progress] = None, keep_blocks: bool = False) -> ConvertResult:
    """Convert SRC (HF folder or .gguf file) into a flexh2o checkpoint at DST, with what a run needs beside the
    weights (weights/run_files.py); nothing is left at DST on error. dtype auto: the source's own (source_dtype).
    keep_blocks: a GGUF's Q4_0/Q4_1/Q8_0/Q4_K tensors are kept in their own blocks (weights/blocks.py), not
    expanded into `dtype` (flexh2o-convert and weights/source.py keep them unless asked to expand)."""
    start = time.perf_counter()
    if os.path.isfile(src) and src.endswith(".gguf"):
        cfg, source = gguf_source(src, keep_blocks)
    elif os.path.isdir(src):
        cfg, source = _hf_source(src)
    else:
        raise ValueError(f"{src} is neither a Hugging Face model folder nor a .gguf file")
    dtype = source_dtype(src, keep_blocks) if dtype == "auto" else dtype_name(parse_dtype(dtype))
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
        kept = write_run_files(src, w.stage)
        try:
            w.finish()
        except ValueError as e:
            raise ValueError(f"{src}: {e}") from None
    return ConvertResult(cfg, len(w.entries), w.num_bytes, time.perf_counter() - start, dtype, tuple(kept))


def source_dtype(src: str, keep_blocks: bool = True) -> str:
    """The dtype `auto` stores: a Hugging Face folder's (its config.json's dtype or torch_dtype, float32 when none);
    a GGUF's tensors that are not kept in blocks, without loss (gguf_source.stored_dtype)."""
    if src.endswith(".gguf"):
        return stored_dtype(src, keep_blocks)
    d = _hf_config_dict(src)
    named = d.get("dtype") or d.get("torch_dtype")
    return named if named in ("float32", "float16", "bfloat16") else "float32"


def _hf_config_dict(src: str) -> dict:
    try:
        with open(os.path.join(src, "config.json")) as fh:
            d = json.load(fh)
    except (OSError, ValueError):
        return {}  # _hf_source reports the unreadable config
    return d if isinstance(d, dict) else {}


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
    if not key.startswith("model."):  # saved from a base model (OPTModel's decoder.*, LlamaModel's layers.*)
        return "model." + key
    return key
