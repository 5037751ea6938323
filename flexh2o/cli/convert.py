"""`flexh2o-convert SRC DST`: Hugging Face folder or llama .gguf -> flexh2o checkpoint. No logic beyond argv."""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from flexh2o.cli.console import Parser, run_main
from flexh2o.cli.model_source import ConvertBar
from flexh2o.weights.convert import convert
from flexh2o.weights.format import DTYPES


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flexh2o-convert",
               description="Convert a Hugging Face checkpoint folder (OPT or Llama; safetensors or "
                           ".bin, sharded or not) or a llama .gguf file into flexh2o's format.")
    p.add_argument("src", metavar="SRC", help="Hugging Face model folder (with config.json) or a .gguf file")
    p.add_argument("dst", metavar="DST", help="output directory (must not exist or be empty)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float16", help="stored dtype (default float16)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing flexh2o checkpoint at DST")
    p.add_argument("--keep-blocks", action="store_true", help="a .gguf's Q4_0/Q4_1/Q8_0/Q4_K tensors stay in their "
                   "own quantized blocks (runs use them compressed), not expanded into --dtype")
    return p


def main(argv: Optional[list] = None) -> int:
    return run_main("flexh2o-convert", lambda: _convert(build_parser().parse_args(argv)),
                    "interrupted; nothing written")


def _convert(args) -> int:
    bar = ConvertBar(sys.stderr.isatty())
    try:
        result = convert(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite, progress=bar,
                         keep_blocks=args.keep_blocks)
    finally:
        bar.close()
    print(f"converted {result.config.name} ({result.config.family}): {result.num_tensors} tensors, "
          f"{result.num_bytes / 2**20:.1f} MiB ({result.num_bytes} bytes) as {args.dtype} in "
          f"{result.seconds:.1f} s -> {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
