"""The converted checkpoint on disk: one raw little-endian file per tensor, an index, and the model config.

Layout of a checkpoint directory DST:
    flexh2o_config.json   ModelConfig.to_json(); written last, so its presence marks a complete checkpoint
    index.json            {"format": 1, "dtype": ..., "tensors": {name: {file, shape, dtype, nbytes, blake2b}}}
    tensors/<name>.bin    contiguous bytes of the tensor, C order, little-endian

blake2b is the hex BLAKE2b-128 digest of the file, computed while it is written and checked while it is read, chunk
by chunk as each chunk arrives (no second pass over the tensor); indexes written before it existed load unchecked.
While converting, DST's staging directory (.DST.partial-*) holds a lock (storage/dirlock.py); a later convert to the
same DST removes staging directories whose lock is free (a convert killed by a signal or kill -9).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import torch

from flexh2o.compress.codec import CompressedTensor, dequantize
from flexh2o.config import CONFIG_FILE, ModelConfig, load_converted_config
from flexh2o.dtypes import DTYPES, dtype_name, parse_dtype
from flexh2o.models import family_module, unique_specs
from flexh2o.storage.base import as_bytes
from flexh2o.storage.dirlock import LOCK_FILE, make_locked_dir, stale_staging
from flexh2o.weights import blocks
from flexh2o.weights.index import FIX, FORMAT_VERSION, INDEX_FILE, index_dtype, read_index, spec_nbytes

TENSOR_DIR = "tensors"
CHUNK = 8 << 20  # bytes hashed per piece, while the piece is still in cache


def digest():
    return hashlib.blake2b(digest_size=16)


def file_name(name: str) -> str:
    """Tensor name -> a safe file name inside tensors/."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) + ".bin"


def _check_byteorder() -> None:
    if sys.byteorder != "little":
        raise ValueError("flexh2o checkpoints are little-endian; this host is big-endian")


class CheckpointWriter:
    """Writes a checkpoint into a staging directory beside DST and moves it into place on finish().

    Use as a context manager: on any exception the staging directory is removed and DST is left as it was.
    """

    def __init__(self, dst: str, cfg: ModelConfig, dtype: str = "float16", overwrite: bool = False):
        _check_byteorder()
        self.dst = os.path.abspath(dst)
        self.cfg = cfg
        self.dtype = parse_dtype(dtype)
        self.dtype_name = dtype_name(self.dtype)
        self.specs = unique_specs(cfg)
        self.entries: dict = {}
        self.num_bytes = 0
        _check_dst(self.dst, overwrite)
        parent = os.path.dirname(self.dst)
        os.makedirs(parent, exist_ok=True)
        sweep_staging(self.dst)
        self.stage_dir = make_locked_dir(parent, f".{os.path.basename(self.dst)}.partial-")
        self.stage = self.stage_dir.path
        os.mkdir(os.path.join(self.stage, TENSOR_DIR))

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def add(self, name: str, tensor) -> None:
        """Validate `name` and shape against the model's specs, cast to the checkpoint dtype, and write it; a
        CompressedTensor (a GGUF tensor's kept blocks) is written as it is: data, then meta."""
        spec = self.specs.get(name)
        if spec is None:
            raise ValueError(f"unexpected tensor {name!r} for a {self.cfg.family} model with this config")
        if name in self.entries:
            raise ValueError(f"tensor {name!r} was given twice")
        if tuple(tensor.shape) != tuple(spec.shape):
            raise ValueError(f"tensor {name!r} has shape {list(tensor.shape)} but the config implies "
                             f"{list(spec.shape)}: check config.json matches the weights")
        if isinstance(tensor, CompressedTensor):
            _check_finite(name, tensor.meta, tensor.meta)
            parts, extra = (tensor.data.contiguous(), tensor.meta.contiguous()), blocks.blocks_entry(tensor)
        else:
            t = tensor.detach().to(device="cpu", dtype=self.dtype).contiguous()
            _check_finite(name, tensor, t)
            parts, extra = (t,), {"dtype": self.dtype_name}
        fname = file_name(name)
        path = os.path.join(self.stage, TENSOR_DIR, fname)
        h, nbytes = digest(), 0
        with open(path + ".tmp", "wb") as fh:
            for part in parts:
                data = memoryview(as_bytes(part).numpy())
                for i in range(0, len(data), CHUNK):
                    fh.write(data[i:i + CHUNK])
                    h.update(data[i:i + CHUNK])
                nbytes += len(data)
        os.replace(path + ".tmp", path)
        self.entries[name] = {"file": fname, "shape": list(spec.shape), **extra, "nbytes": nbytes,
                              "blake2b": h.hexdigest()}
        self.num_bytes += nbytes

    def missing(self) -> list:
        """Spec names not yet written."""
        return [n for n in self.specs if n not in self.entries]

    def finish(self) -> None:
        """Check completeness, write index.json then the config, and move the checkpoint to DST."""
        missing = self.missing()
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ValueError(f"missing tensors {', '.join(missing[:3])}{more}: the source checkpoint is incomplete")
        index = {"format": FORMAT_VERSION, "dtype": self.dtype_name, "tensors": self.entries}
        _write_atomic(os.path.join(self.stage, INDEX_FILE), json.dumps(index, indent=1))
        _write_atomic(os.path.join(self.stage, CONFIG_FILE), self.cfg.to_json())
        os.unlink(os.path.join(self.stage, LOCK_FILE))  # still held (the fd) until the move is done
        _move_into_place(self.stage, self.dst)
        self.stage_dir.release()

    def abort(self) -> None:
        """Remove everything this writer created."""
        self.stage_dir.remove()


def sweep_staging(dst: str) -> list:
    """Remove DST's staging (.DST.partial-*) and replaced (.DST.old-*) directories left by killed converts."""
    parent, base, removed = os.path.dirname(os.path.abspath(dst)), os.path.basename(os.path.abspath(dst)), []
    for name in sorted(os.listdir(parent)):
        path = os.path.join(parent, name)
        if (name.startswith((f".{base}.partial-", f".{base}.old-")) and os.path.isdir(path)
                and not os.path.islink(path) and stale_staging(path)):
            shutil.rmtree(path, ignore_errors=True)
            print(f"flexh2o-convert: removed {path} left by an interrupted convert", file=sys.stderr)
            removed.append(path)
    return removed


def _check_finite(name: str, source: torch.Tensor, stored: torch.Tensor) -> None:
    """NaN/Inf in a tensor is refused here, at conversion, not found later as NaN logits."""
    if not stored.is_floating_point() or bool(torch.isfinite(stored).all()):
        return
    bad = int((~torch.isfinite(stored)).sum())
    if source.is_floating_point() and bool(torch.isfinite(source).all()):
        raise ValueError(f"tensor {name!r}: {bad} values overflow {dtype_name(stored.dtype)} (beyond its range): "
                         "convert with --dtype bfloat16 or float32")
    raise ValueError(f"tensor {name!r} holds {bad} NaN/Inf values: the source checkpoint is corrupt; download it "
                     "again")


def _check_dst(dst: str, overwrite: bool) -> None:
    if not os.path.lexists(dst):
        return
    if not os.path.isdir(dst) or os.path.islink(dst):
        raise ValueError(f"{dst} exists and is not a directory: choose another destination")
    if not os.listdir(dst):
        return
    if not overwrite:
        raise ValueError(f"{dst} exists and is not empty: pass --overwrite or choose another destination")
    if not any(os.path.exists(os.path.join(dst, f)) for f in (INDEX_FILE, CONFIG_FILE)):
        raise ValueError(f"{dst} is not empty and is not a flexh2o checkpoint: refusing to overwrite it")


def _write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as fh:
        fh.write(text)
    os.replace(path + ".tmp", path)


def _move_into_place(stage: str, dst: str) -> None:
    """Swap the finished staging directory in for DST (an old checkpoint there is removed only after)."""
    old = None
    if os.path.isdir(dst):
        if os.listdir(dst):
            old = tempfile.mkdtemp(dir=os.path.dirname(dst), prefix=f".{os.path.basename(dst)}.old-")
            os.rmdir(old)
            os.rename(dst, old)
        else:
            os.rmdir(dst)
    os.rename(stage, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class CheckpointReader:
    """Opens and validates a converted checkpoint; reads one tensor at a time."""

    def __init__(self, path: str):
        _check_byteorder()
        self.path = os.path.abspath(path)
        self.config = load_converted_config(self.path)
        try:
            family_module(self.config.family)
        except ValueError as e:  # a hand-edited family, refused as load_converted_config refuses a bad field
            where = os.path.join(self.path, CONFIG_FILE)
            raise ValueError(f"{where} is corrupt ({e}): run flexh2o-convert again") from None
        index = read_index(os.path.join(self.path, INDEX_FILE))
        self.entries, self._dtype = index["tensors"], index.get("dtype")
        self._validate()

    def stored_dtype(self) -> torch.dtype:
        """The dtype its tensors are stored in (those not kept in blocks): index.json's, as read when opened."""
        return index_dtype(self._dtype, os.path.join(self.path, INDEX_FILE))

    def names(self) -> list:
        return list(self.entries)

    def file_of(self, name: str) -> str:
        """Absolute path of the file holding `name`."""
        if name not in self.entries:
            raise ValueError(f"{self.path} has no tensor {name!r}")
        return os.path.join(self.path, TENSOR_DIR, self.entries[name]["file"])

    def shape(self, name: str) -> tuple:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self.entries[name]["dtype"]]

    def read(self, name: str):
        """A new CPU tensor in the stored dtype, or the CompressedTensor of a tensor kept in blocks."""
        e = self.entries[name]
        if "blocks" in e:
            out = torch.empty(e["nbytes"], dtype=torch.uint8)
            self._read_raw(name, out)
            return blocks.split(out, e)
        out = torch.empty(self.shape(name), dtype=self.dtype(name))
        self._read_raw(name, out)
        return out

    def kept(self) -> dict:
        """name -> CompressionSpec of the tensors kept in blocks (a GGUF's own quantization)."""
        return {n: blocks.entry_spec(e) for n, e in self.entries.items() if "blocks" in e}

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Fill `out` (same shape, any dtype or device); reads straight into it when CPU, contiguous, same dtype."""
        if tuple(out.shape) != self.shape(name):
            raise ValueError(f"cannot read {name!r} of shape {list(self.shape(name))} into {list(out.shape)}")
        if "blocks" in self.entries[name]:
            out.copy_(dequantize(self.read(name), out.dtype))
        elif out.device.type == "cpu" and out.dtype == self.dtype(name) and out.is_contiguous():
            self._read_raw(name, out)
        else:
            out.copy_(self.read(name))

    def _read_raw(self, name: str, out: torch.Tensor) -> None:
        """Read the file into `out` piece by piece, hashing each piece right after it is read (when the index has
        a checksum); a mismatch is refused naming the file."""
        path, e = self.file_of(name), self.entries[name]
        view, got = memoryview(as_bytes(out).numpy()), 0
        h = digest() if "blake2b" in e else None
        with open(path, "rb", buffering=0) as fh:
            while got < len(view):
                n = fh.readinto(view[got:got + CHUNK])
                if not n:
                    break
                if h is not None:
                    h.update(view[got:got + n])
                got += n
        if got != e["nbytes"]:
            raise ValueError(f"{path} is truncated: {got} of {e['nbytes']} bytes; {FIX}")
        if h is not None and h.hexdigest() != e["blake2b"]:
            raise ValueError(f"{path} does not match its checksum in {INDEX_FILE} (blake2b): the file is corrupt; "
                             f"{FIX}")

    def _validate(self) -> None:
        index = os.path.join(self.path, INDEX_FILE)
        for name, spec in unique_specs(self.config).items():
            e = self.entries.get(name)
            if e is None:
                raise ValueError(f"{index} lacks tensor {name!r} required by {CONFIG_FILE}; {FIX}")
            if tuple(e["shape"]) != tuple(spec.shape):
                raise ValueError(f"{index}: tensor {name!r} has shape {e['shape']} but {CONFIG_FILE} implies "
                                 f"{list(spec.shape)}; {FIX}")
        for name, e in self.entries.items():
            path = self.file_of(name)
            want = spec_nbytes(e)
            if e["nbytes"] != want:
                raise ValueError(f"{index}: tensor {name!r} records {e['nbytes']} bytes, expected {want}; {FIX}")
            if not os.path.isfile(path):
                raise ValueError(f"{path} is missing; {FIX}")
            size = os.path.getsize(path)
            if size < want:
                raise ValueError(f"{path} is truncated: {size} of {want} bytes; {FIX}")
            if size > want:
                raise ValueError(f"{path} is too long: {size} bytes, expected {want}; {FIX}")
