"""`flexh2o-convert SRC DST`: Hugging Face folder or .gguf file -> flexh2o checkpoint. No logic beyond argv."""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from flexh2o.cli.console import Parser, run_main
from flexh2o.cli.help_text import declared_families


def build_parser() -> argparse.ArgumentParser:
    # the families as the family modules declare them, read from their source (importing them imports torch)
    p = Parser(prog="flexh2o-convert",
               description="Convert a Hugging Face checkpoint folder (config.json; safetensors or .bin, sharded or "
                           f"not) or a .gguf file of a family flexh2o runs ({', '.join(declared_families())}: "
                           "docs/models.md; any other is refused naming these) into flexh2o's format, "
                           "with its tokenizer, EOS id and chat template, so that flexh2o-run --path DST needs "
                           "nothing else.")
    p.add_argument("src", metavar="SRC", help="Hugging Face model folder (with config.json) or a .gguf file")
    p.add_argument("dst", metavar="DST", help="output directory (must not exist or be empty)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto", help="stored dtype: auto keeps the "
                   "source's own (a folder's config.json dtype, float32 when none; a GGUF's unquantized tensors "
                   "without loss); a narrower one only when named (default auto)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing flexh2o checkpoint at DST")
    p.add_argument("--expand-blocks", action="store_true", help="a .gguf's Q4_0/Q4_1/Q8_0/Q4_K tensors are "
                   "expanded into --dtype (float32 with auto) instead of kept in their own quantized blocks, as "
                   "llama.cpp keeps them (the default)")
    p.add_argument("--keep-blocks", action="store_true", help="keep a .gguf's quantized blocks: what happens "
                   "anyway (taken for older command lines)")
    return p


def main(argv: Optional[list] = None) -> int:
    return run_main("flexh2o-convert", lambda: _convert(build_parser().parse_args(argv)),
                    "interrupted; nothing written")


def _convert(args) -> int:
    from flexh2o.cli.model_source import ConvertBar
    from flexh2o.weights.convert import convert
    if args.keep_blocks and args.expand_blocks:
        raise ValueError("--keep-blocks and --expand-blocks contradict each other: give one (keeping is the default)")
    bar = ConvertBar(sys.stderr.isatty())
    try:
        result = convert(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite, progress=bar,
                         keep_blocks=not args.expand_blocks)
    finally:
        bar.close()
    why = "the source's own" if args.dtype == "auto" else "as --dtype asked"
    kept = ", ".join(result.kept) or "no tokenizer or chat template (the source holds none)"
    print(f"converted {result.config.name} ({result.config.family}): {result.num_tensors} tensors, "
          f"{result.num_bytes / 2**20:.1f} MiB ({result.num_bytes} bytes) as {result.dtype} ({why}"
          f"{'; quantized blocks kept' if args.src.endswith('.gguf') and not args.expand_blocks else ''}), "
          f"with {kept}, in {result.seconds:.1f} s -> {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
