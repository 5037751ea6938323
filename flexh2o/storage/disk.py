"""Disk tier: one file per tensor, read and written with direct I/O (O_DIRECT) through 4096-byte-aligned buffers.

Direct I/O keeps the page cache out of the way, so disk throughput is measured honestly and offloaded data does not
quietly occupy host memory. Where the filesystem refuses O_DIRECT, the tier falls back to buffered I/O and evicts the
pages it touched (posix_fadvise DONTNEED) after every read and write.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import os
import shutil
import sys
import threading
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from flexh2o.storage.base import Tier, TierError, TierFullError, as_bytes, nbytes_of
from flexh2o.storage.offload_dir import OWNER_FILE
from flexh2o.units import ALIGN, fmt_bytes, padded as round_up

STAGE_BYTES = 16 << 20  # staging buffer used to stream writes (bounds extra RAM per store)


@dataclass(frozen=True)
class DiskHandle:
    """One tensor's file: its path, logical shape/dtype and real (unpadded) size in bytes."""
    path: str
    shape: tuple
    dtype: torch.dtype
    nbytes: int

    @property
    def padded(self) -> int:
        """File size: nbytes rounded up to ALIGN."""
        return round_up(self.nbytes)


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` whose data pointer is ALIGN-aligned (a slice of one ALIGN bytes larger)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = -raw.data_ptr() % ALIGN
    return raw[start:start + nbytes]


def _memview(buf: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous uint8 CPU tensor (the caller keeps `buf` alive)."""
    return memoryview((ctypes.c_ubyte * buf.numel()).from_address(buf.data_ptr())).cast("B")


def probe_direct_io(directory: str) -> bool:
    """True when files in `directory` can be opened with O_DIRECT (EINVAL at open means no)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    path = os.path.join(directory, f".direct-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flag, 0o600)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        if os.path.exists(path):
            os.unlink(path)
    os.close(fd)
    return True


class DiskTier(Tier):
    """Tensors in files under `directory` (the run directory, owned by this tier: close() removes it; a locked run
    dir from make_run_dir is removed with its lock, also when this constructor fails).

    Capacity counts the real tensor bytes, as the memory plan does; each file's padding (< 4096 bytes) is not counted.
    """

    name = "disk"

    def __init__(self, directory, capacity: int):
        super().__init__(capacity)
        self.run_dir = directory if hasattr(directory, "remove") else None
        self.directory = os.fspath(directory)
        self._files: dict[str, DiskHandle] = {}
        try:
            with self._io_errors("preparing"):
                os.makedirs(self.directory, exist_ok=True)
                self.is_direct = probe_direct_io(self.directory)
        except BaseException:
            self.close()
            raise
        if not self.is_direct:
            print(f"flexh2o: warning: {directory} does not support direct I/O (O_DIRECT); "
                  "using buffered I/O with page-cache eviction", file=sys.stderr)
        self._ids = itertools.count()
        self._lock = threading.Lock()

    # -- allocation ---------------------------------------------------------------------------------------------------
    def alloc(self, shape: tuple, dtype: torch.dtype) -> DiskHandle:
        shape = tuple(int(d) for d in shape)
        handle = DiskHandle(os.path.join(self.directory, f"t{next(self._ids):06d}.bin"), shape, dtype,
                            nbytes_of(shape, dtype))
        with self._lock:
            self._reserve(handle.nbytes)
            self._files[handle.path] = handle
        try:
            with self._io_errors("creating", handle):
                fd = os.open(handle.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, handle.padded)  # sparse until written
                finally:
                    os.close(fd)
        except BaseException:
            self.free(handle)
            raise
        return handle

    def free(self, handle: DiskHandle) -> None:
        """Delete the file and release its capacity; freeing twice is a no-op."""
        with self._lock:
            if self._files.pop(handle.path, None) is None:
                return
            self._release(handle.nbytes)
        try:
            os.unlink(handle.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Delete every file, then the run directory (only if nothing foreign is left in it). Idempotent."""
        for handle in list(self._files.values()):
            self.free(handle)
        if self.run_dir is not None:
            self.run_dir.remove()
            return
        try:
            os.unlink(os.path.join(self.directory, OWNER_FILE))
        except FileNotFoundError:
            pass
        try:
            os.rmdir(self.directory)
        except OSError:
            pass  # already gone, or holds files this tier did not create

    # -- I/O ----------------------------------------------------------------------------------------------------------
    def load(self, handle: DiskHandle, device: torch.device, dtype: Optional[torch.dtype] = None,
             buf: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Read the file into `buf` (an aligned uint8 buffer of handle.padded bytes, e.g. from ReadBuffers) or a
        fresh one (RAM: padded size + ALIGN); the GIL is released while reading. The result is a view of the buffer
        when it is already on `device` in `dtype`."""
        buf = aligned_empty(handle.padded) if buf is None else buf
        with self._io_errors("reading", handle):
            fd = self._open(handle.path, os.O_RDONLY)
            try:
                _read_all(fd, buf)
                self._evict(fd, sync=False)
            finally:
                os.close(fd)
        with self._lock:
            self.bytes_loaded += handle.nbytes
        out = buf[:handle.nbytes].view(handle.dtype).view(handle.shape)  # (handle.shape), a view of buf
        want = dtype or handle.dtype
        if out.device == torch.device(device) and out.dtype == want:
            return out
        return out.to(device=device, dtype=want)

    def read_spans(self, handle: DiskHandle, spans: list) -> None:
        """Read parts of a tensor's file, e.g. a table's rows: spans [(offset, buf)], each offset a multiple of ALIGN
        and each buf an aligned uint8 buffer of a multiple of ALIGN bytes within the padded file (one open)."""
        with self._io_errors("reading", handle):
            fd = self._open(handle.path, os.O_RDONLY)
            try:
                for offset, buf in spans:
                    _read_all(fd, buf, offset)
                self._evict(fd, sync=False)
            finally:
                os.close(fd)
        with self._lock:
            self.bytes_loaded += sum(buf.numel() for _, buf in spans)

    def store(self, handle: DiskHandle, tensor: torch.Tensor, slots: Optional[torch.Tensor] = None) -> None:
        """Write the whole tensor. `slots` is ignored on purpose: one slot of a (b, h, s, d) cache is h*d elements per
        batch row, scattered in b*h runs far smaller than the 4096-byte direct-I/O block, so per-slot writes would
        turn into read-modify-write of whole blocks anyway; one sequential write of the tensor is cheaper."""
        if tuple(tensor.shape) != handle.shape:
            raise ValueError(f"disk store: tensor shape {tuple(tensor.shape)} != handle shape {handle.shape}")
        data = as_bytes(tensor.to(dtype=handle.dtype))
        self.write_from(handle, (data[i:i + STAGE_BYTES] for i in range(0, data.numel(), STAGE_BYTES)))

    def write_from(self, handle: DiskHandle, chunks: Iterable[torch.Tensor]) -> None:
        """Write the file from consecutive pieces (any dtype/device, viewed as bytes) at increasing offsets, through
        one staging buffer, so a huge tensor never has to exist whole in memory. The pieces must add up to exactly
        handle.nbytes."""
        with self._io_errors("writing", handle):
            self._write_from(handle, chunks)
        with self._lock:
            self.bytes_stored += handle.nbytes

    def _write_from(self, handle: DiskHandle, chunks: Iterable[torch.Tensor]) -> None:
        stage = aligned_empty(min(STAGE_BYTES, handle.padded))
        fill = offset = total = 0
        fd = self._open(handle.path, os.O_WRONLY)
        try:
            for chunk in chunks:
                data = as_bytes(chunk.detach().cpu())
                total += data.numel()
                if total > handle.nbytes:
                    raise ValueError(f"disk write: more than {handle.nbytes} bytes for {handle.path}")
                pos = 0
                while pos < data.numel():
                    k = min(stage.numel() - fill, data.numel() - pos)
                    stage[fill:fill + k].copy_(data[pos:pos + k])
                    fill, pos = fill + k, pos + k
                    if fill == stage.numel():
                        _write_all(fd, stage, offset)
                        offset, fill = offset + fill, 0
            if total != handle.nbytes:
                raise ValueError(f"disk write: got {total} bytes, expected {handle.nbytes} for {handle.path}")
            if fill:
                tail = round_up(fill)
                stage[fill:tail].zero_()
                _write_all(fd, stage[:tail], offset)
            self._evict(fd, sync=True)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _io_errors(self, doing: str, handle: Optional[DiskHandle] = None):
        """OSError/EOFError of the filesystem under a running job -> one line naming the tier, the directory, the
        bytes and the fix (a full disk: the flag too)."""
        try:
            yield
        except EOFError as e:
            raise TierError(f"{e} in {self.directory}: an offload file was truncated by something "
                            "else during the run; do not touch --offload-dir during a run, and rerun") from None
        except OSError as e:
            need = handle.nbytes if handle else 0
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                free = _free_bytes(self.directory)
                raise TierFullError(
                    f"disk tier: no space left in {self.directory} ({e.strerror}) while {doing} {need} bytes "
                    f"({fmt_bytes(need)}): the run holds {self.used} bytes there and asked for up to "
                    f"{self.capacity} (--disk-mem), but the filesystem has {free} bytes ({fmt_bytes(free)}) free; "
                    "free space, pass --offload-dir on a larger filesystem, or lower --disk-mem / move --percent "
                    "to memory") from None
            what = os.path.basename(handle.path) if handle else self.directory
            raise TierError(f"disk tier: {doing} {what} in {self.directory} failed: {e.strerror or e} "
                            f"(errno {e.errno}); check --offload-dir (space, inodes, permissions) and rerun") from None

    def _open(self, path: str, flags: int) -> int:
        return os.open(path, flags | (os.O_DIRECT if self.is_direct else 0))

    def _evict(self, fd: int, sync: bool) -> None:
        """Buffered fallback only: drop this file's pages from the page cache (dirty pages must be written first)."""
        if self.is_direct:
            return
        if sync:
            os.fdatasync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _free_bytes(directory: str) -> int:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return 0


def _read_all(fd: int, buf: torch.Tensor, offset: int = 0) -> None:
    """Fill `buf` from the file's `offset`, looping on short reads; os.preadv releases the GIL."""
    view, pos = _memview(buf), 0
    while pos < len(view):
        n = os.preadv(fd, [view[pos:]], offset + pos)
        if n == 0:
            raise EOFError(f"disk tier: file ended after {pos} of {len(view)} bytes")
        pos += n


def _write_all(fd: int, buf: torch.Tensor, offset: int) -> None:
    """Write all of `buf` at `offset`, looping on short writes; os.pwritev releases the GIL."""
    view, pos = _memview(buf), 0
    while pos < len(view):
        pos += os.pwritev(fd, [view[pos:]], offset + pos)
