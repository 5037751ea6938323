"""The memory-resident decode set-up that benchmarks/decode_step.py and op_count.py share: their common flags
(model, dtype for both systems, batch, prompt length) and the prompts and RunConfig built from them."""
from __future__ import annotations

import argparse

from flexh2o.config import from_name
from flexh2o.dtypes import parse_dtype
from flexh2o.placement import Percent
from flexh2o.run_config import RunConfig


def add_flags(ap: argparse.ArgumentParser, prompt_len: int) -> None:
    ap.add_argument("--model", default="opt-125m")
    ap.add_argument("--dtype", default="float32", help="both systems' weights and compute (flexh2o: --dtype and "
                    "--compute-dtype alike)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=prompt_len)


def prompts_and_config(args, percent: list, gen_len: int, **kw) -> tuple:
    """(prompts, rc): args.batch distinct synthetic prompts and one GPU batch of them at args.dtype, placed by
    `percent`; kw: other RunConfig fields."""
    cfg, dtype = from_name(args.model), parse_dtype(args.dtype)
    prompts = [list(range(10 + i, 10 + i + args.prompt_len)) for i in range(args.batch)]
    return prompts, RunConfig(model=cfg, percent=Percent.parse(percent), gpu_batch_size=args.batch,
                              prompt_len=args.prompt_len, gen_len=gen_len, dtype=dtype, compute_dtype=dtype, **kw)
