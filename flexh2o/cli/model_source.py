"""--model / --path: the one model-source resolver (weights/source.py) with a progress bar on stderr while a
Hugging Face folder or .gguf file is converted the first time."""
from __future__ import annotations

import os
import sys

from flexh2o.planning.machine import models_dir


def resolve_source(args, prog: str) -> None:
    """Point args.path at the checkpoint to load and args.tokenizer at its tokenizer (unless --tokenizer names one):
    --model NAME|FOLDER|FILE as weights/source.py resolves it (a built-in name stays in args.model, seeded random
    weights), --path a checkpoint (as given) or a Hugging Face folder or .gguf file (converted once, as --model)."""
    from flexh2o.weights.source import resolve
    from flexh2o.weights.source_cache import is_source
    if args.model is None and args.path == "_DUMMY_":
        return
    given, what = (args.model, "--model") if args.model is not None else (args.path, "--path")
    if what == "--path" and not (is_source(given) or given.endswith(".gguf")):  # a checkpoint (checked when read)
        if getattr(args, "tokenizer", "") is None and os.path.isfile(os.path.join(given, "tokenizer.json")):
            args.tokenizer = given
        return
    bar = ConvertBar(sys.stderr.isatty())
    try:
        src = resolve(given, models_dir(), getattr(args, "tokenizer", None), what, progress=bar)
    finally:
        bar.close()
    if src.origin is not None:
        how = "converted once into" if src.fresh else "already converted:"
        print(f"{prog}: {src.origin} {how} {src.path}", file=sys.stderr)
    if hasattr(args, "tokenizer"):
        args.tokenizer = src.tokenizer
    if src.path is not None:
        args.path, args.model = src.path, None


def open_checkpoint(path: str):
    """The converted checkpoint at --path opened (its CheckpointReader, read by the run's RunConfig and engine),
    its index checked against its config (tensor shapes, file sizes) before anything is planned from it; a
    mismatch names --path."""
    from flexh2o.weights.format import CheckpointReader
    try:
        return CheckpointReader(path)
    except ValueError as e:
        raise ValueError(f"--path {path}: {e}") from None


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
