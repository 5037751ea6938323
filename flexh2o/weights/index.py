"""A converted checkpoint's index.json (weights/format.py): its name, format version, and every entry's fields
checked, kept blocks (weights/blocks.py) included."""
from __future__ import annotations

import os

import torch

from flexh2o.dtypes import DTYPES
from flexh2o.jsonfile import read_json
from flexh2o.weights import blocks

FORMAT_VERSION = 1
INDEX_FILE = "index.json"
FIX = "re-run flexh2o-convert"


def spec_nbytes(entry: dict) -> int:
    """Bytes implied by an index entry's shape and dtype (and blocks)."""
    if "blocks" in entry:
        return blocks.entry_nbytes(entry)
    n = 1
    for d in entry["shape"]:
        n *= d
    return n * torch.empty((), dtype=DTYPES[entry["dtype"]]).element_size()


def read_index(index: str) -> dict:
    """index.json whole ("dtype", "tensors": {name: entry}), with every entry's fields checked."""
    if not os.path.isfile(index):
        raise ValueError(f"{index} is missing; {FIX}")
    d = read_json(index, FIX)
    if not isinstance(d, dict) or d.get("format") != FORMAT_VERSION or not isinstance(d.get("tensors"), dict):
        raise ValueError(f"{index} is not a flexh2o index (format {FORMAT_VERSION}); {FIX}")
    for name, e in d["tensors"].items():
        ok = (isinstance(e, dict) and isinstance(e.get("file"), str) and e.get("dtype") in DTYPES
              and isinstance(e.get("shape"), list) and all(isinstance(x, int) and x >= 0 for x in e["shape"])
              and isinstance(e.get("nbytes"), int) and os.path.basename(e["file"]) == e["file"]
              and isinstance(e.get("blake2b", ""), str) and blocks.entry_ok(e))
        if not ok:
            raise ValueError(f"{index}: entry for {name!r} is malformed; {FIX}")
    return d


def index_dtype(name, index: str) -> torch.dtype:
    """The torch dtype of index.json's "dtype" `name`; ValueError naming `index` where it names none."""
    if name not in DTYPES:
        raise ValueError(f"{index} names no dtype; {FIX}")
    return DTYPES[name]
