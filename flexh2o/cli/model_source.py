"""--model / --path given a Hugging Face folder or a .gguf file: the cached conversion (weights/source_cache.py)
that the run loads, converted with a progress bar on stderr the first time."""
from __future__ import annotations

import os
import sys

from flexh2o.config import CONFIG_FILE
from flexh2o.planning.machine import cache_dir


def resolve_source(args, prog: str) -> None:
    """Point args.path at the checkpoint to load: a converted checkpoint given to --model is taken as --path, and
    a Hugging Face folder or .gguf given to --model or --path is converted once into the cache (args.model then
    None), and is the tokenizer unless --tokenizer names one (a .gguf holds its vocabulary; a folder, when it has
    tokenizer.json), as the Python API does. Built-in names (opt-125m, facebook/opt-30b, ...) are left as they
    are."""
    from flexh2o.weights.source_cache import converted, is_source
    model = args.model
    if model is not None and os.path.isdir(model) and os.path.isfile(os.path.join(model, CONFIG_FILE)):
        args.path, args.model = model, None
        return
    given = model if model is not None and (is_source(model) or model.endswith(".gguf")) else args.path
    if given.endswith(".gguf") and not os.path.isfile(given):
        raise ValueError(f"{given} does not exist: give an existing .gguf file")
    if not is_source(given):
        if model is not None and os.path.isdir(model):
            raise ValueError(f"--model {model}: the folder has no config.json: give a Hugging Face model folder, "
                             "a .gguf file or a flexh2o checkpoint")
        return
    if getattr(args, "tokenizer", "") is None and (given.endswith(".gguf")
                                                   or os.path.isfile(os.path.join(given, "tokenizer.json"))):
        args.tokenizer = given
    bar = ConvertBar(sys.stderr.isatty())
    try:
        path, fresh = converted(given, os.path.join(cache_dir(), "models"), progress=bar)
    finally:
        bar.close()
    how = "converted once into" if fresh else "already converted:"
    print(f"{prog}: {given} {how} {path}", file=sys.stderr)
    args.path, args.model = path, None


class ConvertBar:
    """tqdm bar over tensors on stderr, created on the first tensor (when the total is known); only on a tty."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None

    def __call__(self, name: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="tensor", desc="converting", file=sys.stderr, leave=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
