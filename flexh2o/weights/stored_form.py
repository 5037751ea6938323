"""Which plain weights reach the compute side in their stored dtype (a models.common.StoredWeight) instead of
converted whole into the compute dtype, and the compute-side bytes they take: the one rule that the engine's weight
loads (weights/store.py), the memory plan (through weights/forms.py) and the cost model (tuning/step_cost.py) read.

A step only gathers a few rows of an embedding table, and the vocabulary head (tied or not) can be multiplied a
chunk of its rows at a time, so converting such a table whole sized the compute-side buffers by the largest layer
in the compute dtype (opt-1.3b's 50272 x 2048 table: 393 MiB in fp32, twice in flight), and a tight memory cap then
forced a 2-byte compute dtype that an AVX2 CPU multiplies ~100x slower than fp32. So a 2-D weight of the embedding
layer (0) or the head layer (num_layers + 1), stored uncompressed in another dtype than the phase computes in and
larger than one conversion chunk (models.common.STORED_CHUNK_BYTES in the compute dtype), stays stored: a lookup
converts the rows it gathers, a matmul one chunk of rows at a time into a reused buffer. Smaller ones (one chunk or
less) are converted whole, as before: that is at most one chunk's bytes anyway.

On a CPU run such a table homed on the disk tier is not read whole into a read arena at each load either (that sized
both arenas by the table: opt-1.3b's bf16 one, 2 x 204 MiB beside the converted decoder layers): it comes as a
DiskTable, which reads from the table's file only what a step touches, the rows a lookup gathers and the head's
chunks of rows one after another (the next read while one is multiplied).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flexh2o.models import common
from flexh2o.units import ALIGN, padded


def stays_stored(layer: int, num_layers: int, spec, storage: torch.dtype, compute: torch.dtype,
                 compressed: bool) -> bool:
    """Whether weight `spec` (a WeightSpec) of layer index `layer` comes to the compute side in its stored dtype
    (see the module docstring). compressed: it is held under --compress-weight (those have their own forms)."""
    return (not compressed and storage != compute and (layer == 0 or layer > num_layers) and len(spec.shape) == 2
            and spec.numel * compute.itemsize > common.STORED_CHUNK_BYTES)


def read_by_rows(layer: int, num_layers: int, spec, compressed: bool, home: str, on_cpu: bool) -> bool:
    """Whether weight `spec` of layer index `layer` is read from its disk file by rows and chunks (a DiskTable)
    instead of whole into a read arena at each load: a 2-D embedding or head table of more than one conversion
    chunk in fp32 (every table some compute dtype keeps stored), uncompressed, homed on disk, on a CPU run (in any
    compute dtype)."""
    return (not compressed and home == "disk" and on_cpu and len(spec.shape) == 2
            and (layer == 0 or layer > num_layers) and spec.numel * 4 > common.STORED_CHUNK_BYTES)


def is_multiplied(layer: int) -> bool:
    """Whether the stored weights of `layer` are multiplied (the head) rather than looked up (the embedding)."""
    return layer > 0


def stored_weight_bytes(layer: int, spec, storage: torch.dtype, compute: torch.dtype, in_place: bool,
                        by_rows: bool = False) -> int:
    """Compute-side bytes of a weight that stays stored: its stored bytes where it is not used where it lives (a
    disk read or a copy to the device), plus the chunk buffer a matmul converts into; read by rows (read_by_rows):
    the chunk buffer and two chunks read in the stored dtype (a lookup's rows are counted with the activations)."""
    copy = 0 if in_place or by_rows else spec.numel * storage.itemsize
    return copy + stored_chunk_bytes(layer, spec, storage, compute, by_rows)


def stored_chunk_bytes(layer: int, spec, storage: torch.dtype, compute: torch.dtype, by_rows: bool = False) -> int:
    """The part of stored_weight_bytes taken only while the weight multiplies (transient): its chunk buffer, and
    read by rows its two chunks read in the stored dtype."""
    if not is_multiplied(layer):
        return 0
    width = spec.shape[1]
    rows = min(spec.shape[0], common.stored_chunk_rows(width, compute))
    reads = 2 * (padded(rows * width * storage.itemsize) + ALIGN) if by_rows else 0
    return rows * width * compute.itemsize + reads


def stored_layer_bytes(layer_specs: list, storage: torch.dtype, compute: torch.dtype, compressed) -> tuple:
    """Per layer index: (bytes at the storage dtype of its weights that stay stored and are looked up, of those
    multiplied). compressed: name -> whether --compress-weight holds it."""
    last = len(layer_specs) - 2
    out = []
    for i, layer in enumerate(layer_specs):
        kept = sum(s.numel * storage.itemsize for s in layer
                   if stays_stored(i, last, s, storage, compute, compressed(s.name)))
        out.append((0, kept) if is_multiplied(i) else (kept, 0))
    return tuple(out)


def disk_tables_of_run(rc, memo=None) -> tuple:
    """Per layer index: (stored bytes of its tables read by rows (read_by_rows), their (rows, width) shapes)."""
    from flexh2o.compress.codec import weight_spec
    key = ("disk_tables", rc.percent.shares("weights"), rc.model, rc.dtype, rc.compress_weight, str(rc.device))
    if memo is not None and key in memo:
        return memo[key]
    homes, last, out = rc.placement.weights, rc.model.num_layers, []
    on_cpu = not rc.device.startswith("cuda")
    for i, layer in enumerate(homes.layer_specs):
        got = [s for s in layer if read_by_rows(i, last, s, weight_spec(s.shape, rc.compress_weight, s.name)
                                                is not None, homes[s.name], on_cpu)]
        out.append((sum(s.numel for s in got) * rc.dtype.itemsize, tuple(tuple(s.shape) for s in got)))
    if memo is not None:
        memo[key] = tuple(out)
    return tuple(out)


def disk_table_reads(layer: int, shapes: tuple, storage: torch.dtype, rows: int, batches: int) -> tuple:
    """(bytes, reads) a step takes from the disk for DiskTables of `shapes` (rows, width) at layer index `layer`:
    per GPU batch a lookup reads each of `rows` looked-up rows' aligned span (at most the table), the head the
    whole table, one read per chunk of stored_chunk_rows rows (as many as at fp32 compute, the most)."""
    nbytes = reads = 0
    for n, k in shapes:
        row = k * storage.itemsize
        if is_multiplied(layer):
            nbytes, reads = nbytes + n * row, reads + -(-n // common.stored_chunk_rows(k, torch.float32))
        else:
            got = min(n, rows)
            nbytes, reads = nbytes + min(n * row, got * padded(row)), reads + got
    return batches * nbytes, batches * reads


def stored_of_run(rc, memo=None) -> tuple:
    """stored_layer_bytes of a RunConfig's weights at its compute dtype (kept in `memo` when given: a search costs
    many RunConfigs)."""
    from flexh2o.compress.codec import weight_spec
    key = ("stored_form", rc.model, rc.dtype, rc.compute, rc.compress_weight)
    if memo is not None and key in memo:
        return memo[key]
    specs = rc.placement.weights.layer_specs
    shapes = {s.name: s.shape for layer in specs for s in layer}
    got = stored_layer_bytes(specs, rc.dtype, rc.compute,
                             lambda name: weight_spec(shapes[name], rc.compress_weight, name) is not None)
    if memo is not None:
        memo[key] = got
    return got


@dataclass(frozen=True)
class DiskTable(common.StoredWeight):
    """A table kept stored and homed on the disk tier of a CPU run (read_by_rows), read from its file as a step
    touches it: a lookup reads the rows it gathers, a matmul the table stored_chunk_rows rows at a time, reading
    the next chunk while one is converted and multiplied. `stored` is None: the table is never held whole."""

    tier: object = None  # the DiskTier
    handle: object = None  # its DiskHandle: shape (N, K), stored dtype

    def _span(self, start: int, stop: int) -> tuple:
        """(aligned file offset, aligned buffer, byte offset of row `start` in it) covering rows [start, stop)."""
        row = self.handle.shape[1] * self.handle.dtype.itemsize
        at = start * row // ALIGN * ALIGN
        return at, _aligned(padded(stop * row) - at), start * row - at

    def _rows_of(self, buf: torch.Tensor, skip: int, n: int) -> torch.Tensor:
        """(n, K) in the stored dtype: a view of `buf` from byte `skip`."""
        k = self.handle.shape[1]
        return buf[skip:skip + n * k * self.handle.dtype.itemsize].view(self.handle.dtype).view(n, k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(*ids.shape, K) in the compute dtype: each run of consecutive distinct ids read as one span."""
        uniq, where = torch.unique(ids.reshape(-1), return_inverse=True)  # sorted distinct rows
        spans = [(start, stop, *self._span(start, stop)) for start, stop in _runs(uniq.tolist())]
        self.tier.read_spans(self.handle, [(at, buf) for _, _, at, buf, _ in spans])
        got = torch.cat([self._rows_of(buf, skip, stop - start)
                         for start, stop, _, buf, skip in spans])  # (distinct rows, K)
        return F.embedding(where.view(ids.shape), got).to(self.dtype)

    def linear(self, x: torch.Tensor, bias=None) -> torch.Tensor:
        """x (..., K) -> x @ W.T + bias (..., N) in x's dtype, as StoredWeight.linear, each chunk read from the file."""
        n, k = self.handle.shape
        flat = x.reshape(-1, k)  # (r, K)
        out = torch.empty(flat.shape[0], n, dtype=x.dtype, device=x.device)  # (r, N)
        step = common.stored_chunk_rows(k, x.dtype)
        buf = torch.empty(min(n, step), k, dtype=x.dtype, device=x.device)  # (rows of a chunk, K)
        chunks = [(start, min(n, start + step)) for start in range(0, n, step)]
        with ThreadPoolExecutor(1, thread_name_prefix="flexh2o-table") as pool:
            nxt = pool.submit(self._read, *chunks[0])
            for i, (start, stop) in enumerate(chunks):
                got = nxt.result()  # (chunk, K) in the stored dtype
                w = buf[:stop - start].copy_(got)  # (chunk, K)
                nxt = pool.submit(self._read, *chunks[i + 1]) if i + 1 < len(chunks) else None
                out[:, start:stop] = common.linear(flat, w, None if bias is None else bias[start:stop])
        return out.view(*x.shape[:-1], n)

    def _read(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) in the stored dtype, read into a fresh aligned buffer."""
        at, buf, skip = self._span(start, stop)
        self.tier.read_spans(self.handle, [(at, buf)])
        return self._rows_of(buf, skip, stop - start)


def _aligned(nbytes: int) -> torch.Tensor:
    """An aligned uint8 buffer of `nbytes` (storage/disk.py; imported here, where it is used)."""
    from flexh2o.storage.disk import aligned_empty
    return aligned_empty(nbytes)


def _runs(rows: list) -> list:
    """[(start, stop)] of the runs of consecutive values in sorted distinct `rows`."""
    runs: list = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs
