"""Every weight tensor in its home tier: filled with seeded dummy values or from a converted checkpoint.
With compression, every weight of two or more dimensions is kept compressed (grouped along dimension 0, as
FlexGen does, or along the input dimension for the int4 kernel) and expanded on the compute side, or handed to the
kernel as it is stored; 1-D weights (biases, norms) stay as they are (FlexGen's rule)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from flexh2o.compress import CompressedTensor
from flexh2o.compress.choice import PHASES
from flexh2o.compress.codec import dequantize
from flexh2o.compress.kernels import PackedWeight, kernel_scales
from flexh2o.compress.tier import CompressedTier, KernelOrderTier
from flexh2o.models.common import StoredWeight
from flexh2o.placement import WeightHomes
from flexh2o.storage.disk import DiskTier
from flexh2o.storage.read_buffers import ReadArenas
from flexh2o.weights.dummy import dummy_chunks
from flexh2o.weights.forms import WeightForms
from flexh2o.weights.on_use import ChunkBuffer, OnUseWeight
from flexh2o.weights.stored_form import DiskTable, read_by_rows, stays_stored

READS_IN_FLIGHT = 8  # a layer's disk reads issued at once (queue depth; the link is not filled by one read at a time)


class WeightStore:
    """name -> (tier, handle). `load_layer` hands the compute side a dict of tensors for one layer."""

    def __init__(self, homes: WeightHomes, tiers: dict, forms: WeightForms, keep_scales: bool = False,
                 source=None, progress=None):
        """forms: how each weight is held and reaches the compute side; keep_scales: the memory plan has room to
        keep the int4 kernel's scales built (MemoryPlan.kept_scales); source: the weights' values, a
        CheckpointReader (`fill_from`) or the seed of dummy weights (`fill_dummy`), filled in as the store is made
        (a store is never seen half-built); progress(values) after each tensor."""
        self.specs, self.homes, self.forms = homes.layer_specs, homes, forms
        # names whose kernel scales are built once and kept (weights/forms.py)
        self.kept_scales = forms.kept_scale_names(homes) if keep_scales else frozenset()
        self._scales: dict = {}  # name -> those scales, built at the weight's first load that runs the kernel
        self._compute_tier = tiers.get("gpu")  # charged for the kept scales (the compute side's memory)
        self.dtype = forms.storage
        self.buffers = ConvertBuffers()
        self.tiers = {}  # name -> the tier object that holds it
        self.seconds: dict = {}  # phase -> {"read": s, "expand": s} spent in load_layer (summed over I/O threads)
        self.kernel_order: set = set()  # names stored in the int4 kernel's order (compress/kernels.py)
        self.on_use: set = set()  # (phase, layer, name) of the weights converted on use (weights/on_use.py)
        self.chunks = ChunkBuffer(forms.chunk_buffer_bytes(homes), getattr(self._compute_tier, "charge", None))
        wrapped: dict = {}
        for layer, (specs, held) in enumerate(zip(self.specs, forms.table(homes))):
            for s, w in zip(specs, held):  # w: the weight's WeightForm (a tied table: one per layer it is in)
                spec, home = w.spec, self.homes[s.name]
                self.on_use |= {(p, layer, s.name) for p, f in zip(PHASES, w.forms) if f == "on use"}
                if spec is None:
                    self.tiers[s.name] = tiers[home]
                    continue
                kind = KernelOrderTier if w.kernel_order else CompressedTier
                if kind is KernelOrderTier:
                    self.kernel_order.add(s.name)
                if (kind, home, spec) not in wrapped:
                    wrapped[kind, home, spec] = kind(tiers[home], spec)
                self.tiers[s.name] = wrapped[kind, home, spec]
        self.handles = {}
        for layer in self.specs:
            for s in layer:
                if s.name not in self.handles:
                    self.handles[s.name] = self.tiers[s.name].alloc(s.shape, self.dtype)
        if isinstance(source, int):
            self.fill_dummy(source, progress)
        elif source is not None:
            self.fill_from(source, progress)
        last = len(self.specs) - 2
        self._tables = {s.name for i, layer in enumerate(self.specs) for s in layer  # read by rows (stored_form.py)
                        if read_by_rows(i, last, s, isinstance(self.tiers[s.name], CompressedTier), self.homes[s.name],
                                        tiers["gpu"].device.type == "cpu")}
        self.reads = ReadArenas(max(sum(f.padded for _, files in self._arena_reads(layer, phase) for f in files)
                                    for layer in range(len(self.specs)) for phase in PHASES))
        self._readers: Optional[ThreadPoolExecutor] = None
        self._lent: dict = {}  # id(a load_layer result) -> its ReadArenas token

    def fill_dummy(self, seed: int, progress=None) -> None:
        for name, spec in self._unique():
            self.tiers[name].write_from(self.handles[name], dummy_chunks(spec, seed, self.dtype))
            if progress:
                progress(spec.numel)

    def fill_from(self, reader, progress=None) -> None:
        """Copy every tensor from a CheckpointReader into its home tier, one at a time."""
        for name, spec in self._unique():
            t = reader.read(name)  # a CompressedTensor where the checkpoint keeps blocks (stored as they are)
            if tuple(t.shape) != tuple(spec.shape):
                raise ValueError(f"{reader.file_of(name)} holds shape {tuple(t.shape)}, expected {spec.shape}")
            if isinstance(t, CompressedTensor) and not isinstance(self.tiers[name], CompressedTier):
                t = dequantize(t, torch.float32)  # kept blocks the run stores plain (weights/kept_run.py)
            self.tiers[name].store(self.handles[name], t if isinstance(t, CompressedTensor) else t.to(self.dtype))
            if progress:
                progress(spec.numel)

    def _unique(self):
        seen = set()
        for layer in self.specs:
            for s in layer:
                if s.name not in seen:
                    seen.add(s.name)
                    yield s.name, s

    def load_layer(self, layer: int, device, dtype: torch.dtype, phase: str = "") -> tuple:
        """(name -> tensor on device in dtype, bytes copied). Tensors already there come as they are; compressed ones
        are expanded (into reused buffers on the CPU), or, those in the kernel's order, come as PackedWeights where
        the store's WeightForms say so at `phase` (weights/forms.py).
        Plain weights homed on disk are read READS_IN_FLIGHT at once into one of two read arenas (ReadArenas),
        lent until release(). Large embedding and head tables in another dtype than `dtype` come as StoredWeights
        (weights/stored_form.py); matmul weights the forms convert on use at `phase` as OnUseWeights (converted a
        chunk at a time into self.chunks as they multiply). Seconds reading and expanding add up in seconds[phase]."""
        out, copied, last = {}, 0, len(self.specs) - 2
        start = time.perf_counter()
        token, streamed = self._read_streamed(layer, phase)  # name -> future of the read into an arena's buffer
        packed = self._read_compressed(layer, device, phase)  # name -> future of a compressed disk weight's reads
        spent = [time.perf_counter() - start, 0.0]  # seconds reading, expanding
        for s in self.specs[layer]:
            kept = stays_stored(layer, last, s, self.dtype, dtype, isinstance(self.tiers[s.name], CompressedTier))
            if s.name in self._tables:
                out[s.name] = DiskTable(None, dtype, self.tiers[s.name], self.handles[s.name])  # read by rows, chunks
                continue
            read, on_use = streamed.get(s.name, packed.get(s.name)), (phase, layer, s.name) in self.on_use
            t = self._load_one(layer, s, read, device, self.dtype if kept or on_use else dtype, phase, spent)
            copied += _copied_bytes(t, self.handles[s.name])  # kept scales too, as the plan's layers in flight count
            # converted by rows or chunks (stored_form.py), or by chunks as it multiplies (on_use.py)
            out[s.name] = StoredWeight(t, dtype) if kept else OnUseWeight(t, dtype, self.chunks) if on_use else t
        with self.buffers.lock:
            self._lent[id(out)] = token
            got = self.seconds.setdefault(phase, {"read": 0.0, "expand": 0.0})
            got["read"] += spent[0]
            got["expand"] += spent[1]
        return out, copied

    def _load_one(self, layer: int, s, read, device, dtype: torch.dtype, phase: str, spent: list):
        """One weight of `layer` on the compute side in `dtype` (load_layer; read: the future of its disk read
        issued with the layer's, or None), its seconds reading and expanding added to `spent`."""
        tier, h, on_cpu = self.tiers[s.name], self.handles[s.name], torch.device(device).type == "cpu"
        start = time.perf_counter()
        if not isinstance(tier, CompressedTier):
            t = read.result() if read is not None else tier.load(h, device)
            mid = time.perf_counter()
            if read is not None:  # a view of its read arena where it is used as read
                t = self._own(t, device, dtype)
            elif t.dtype != dtype:
                t = self.buffers.convert(t, dtype) if on_cpu else t.to(dtype)
        else:
            ct = read.result() if read is not None else tier.load_compressed(h, device)
            mid = time.perf_counter()
            form = self.forms.form(layer, len(self.specs) - 2, s, phase) if s.name in self.kernel_order else None
            t = self._expanded(tier, ct, s, dtype, form, on_cpu)
        spent[0] += mid - start
        spent[1] += time.perf_counter() - mid
        return t

    def _expanded(self, tier, ct, s, dtype: torch.dtype, form: Optional[bool], on_cpu: bool):
        """A compressed weight as the compute side takes it: a PackedWeight (form not None), else expanded."""
        if form is not None:  # scales not kept: built only where torch's kernel multiplies (not int4_rows' product)
            return tier.pack(ct, dtype, form, self._kept(s.name, ct) if form else None, lazy=True)
        if on_cpu:
            return tier.expand_into(ct, self.buffers.take(s.shape, dtype))
        return tier.expand(ct, dtype)

    def _kept(self, name: str, ct: CompressedTensor) -> Optional[torch.Tensor]:
        """The kept kernel scales of `name` (built from ct's meta the first time), None when it keeps none."""
        if name not in self.kept_scales:
            return None
        with self.buffers.lock:
            got = self._scales.get(name)
        if got is None:
            got = kernel_scales(ct.meta)
            with self.buffers.lock:
                if name not in self._scales and self._compute_tier is not None:
                    self._compute_tier.charge(_nbytes(got))
                got = self._scales.setdefault(name, got)
        return got

    def _streamed(self, layer: int) -> list:
        """The layer's plain weights homed on the disk tier: read whole into a read arena."""
        return [s for s in self.specs[layer] if isinstance(self.tiers[s.name], DiskTier) and s.name not in self._tables]

    def _pool(self) -> ThreadPoolExecutor:
        """The READS_IN_FLIGHT threads every disk read of a layer is issued to (made at the first)."""
        with self.buffers.lock:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(READS_IN_FLIGHT, thread_name_prefix="flexh2o-read")
            return self._readers

    def _as_read(self, layer: int, s, phase: str) -> bool:
        """Whether a compressed weight comes as a PackedWeight at `phase` (its read bytes used until release)."""
        return s.name in self.kernel_order and self.forms.form(layer, len(self.specs) - 2, s, phase) is not None

    def _read_compressed(self, layer: int, device, phase: str) -> dict:
        """name -> future of load_compressed for the layer's compressed disk weights expanded whole, issued together
        (one at a time left the link idle: a 4-bit opt-350m decode step read at half the plain weights' rate)."""
        return {s.name: self._pool().submit(self.tiers[s.name].load_compressed, self.handles[s.name], device)
                for s in self.specs[layer] if isinstance(self.tiers[s.name], CompressedTier)
                and isinstance(self.tiers[s.name].inner, DiskTier) and not self._as_read(layer, s, phase)}

    def _arena_reads(self, layer: int, phase: str) -> list:
        """(name, files) of the layer's reads into a read arena: each plain disk weight's, then the data and meta of
        each compressed one used as read (a fresh buffer per read: 20 thousand page faults a 4-bit opt-350m step)."""
        return [(s.name, (self.handles[s.name],)) for s in self._streamed(layer)] + [
            (s.name, (self.handles[s.name].data, self.handles[s.name].meta)) for s in self.specs[layer]
            if self._as_read(layer, s, phase) and isinstance(self.tiers[s.name].inner, DiskTier)]

    def _read_streamed(self, layer: int, phase: str) -> tuple:
        """(arena token, name -> future of each `_arena_reads` read), READS_IN_FLIGHT at once into one of the two
        read arenas (on the CPU a future's result is a view of it)."""
        reads = self._arena_reads(layer, phase)
        token, bufs = self.reads.lend([f.padded for _, files in reads for f in files]) if reads else (None, [])
        pool, cpu, out, at = self._pool(), torch.device("cpu"), {}, 0
        for name, files in reads:
            tier, got, at = self.tiers[name], bufs[at:at + len(files)], at + len(files)
            out[name] = (pool.submit(tier.load, files[0], cpu, None, got[0]) if len(files) == 1 else
                         pool.submit(tier.load_compressed, self.handles[name], cpu, tuple(got)))
        return token, out

    def _own(self, t: torch.Tensor, device, dtype: torch.dtype) -> torch.Tensor:
        """A streamed weight on `device` in `dtype`: the arena's view itself where it already is, else a copy."""
        if t.device == torch.device(device) and t.dtype == dtype:
            return t
        return self.buffers.convert(t, dtype) if torch.device(device).type == "cpu" else t.to(device, dtype)

    def release(self, tensors: dict) -> None:
        """Hand a layer's tensors from load_layer back once its compute is done (converted buffers are reused, the
        read arena serves the next load)."""
        with self.buffers.lock:
            token = self._lent.pop(id(tensors), None)
        self.reads.give(token)
        for t in tensors.values():
            if isinstance(t, torch.Tensor):
                self.buffers.give(t)

    def tensor(self, name: str, device="cpu", dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """One weight as the compute side sees it (expanded when compressed), e.g. to build a reference model."""
        return self.tiers[name].load(self.handles[name], torch.device(device), dtype)

    def close(self) -> None:
        if self._readers is not None:
            self._readers.shutdown(wait=True)
            self._readers = None
        for name, h in self.handles.items():
            self.tiers[name].free(h)
        self.handles, self._scales = {}, {}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _copied_bytes(t, h) -> int:
    """Bytes a loaded weight takes on the compute side apart from its home (0 when it is the home tensor)."""
    if isinstance(t, PackedWeight):
        return t.nbytes()
    if isinstance(h, torch.Tensor) and t.data_ptr() == h.data_ptr():
        return 0
    return t.numel() * t.element_size()


class ConvertBuffers:
    """Reused buffers for weights converted to the compute dtype on the CPU. A fresh large tensor is mapped and
    page-faulted on every allocation, which made a float16 -> float32 conversion ~5x slower than a copy into memory
    already touched; buffers come back through give() (thread-safe: loads run on the I/O threads)."""

    def __init__(self):
        self.free: dict = {}  # (shape, dtype) -> [tensor]
        self.lent: set = set()  # data_ptr of buffers handed out
        self.lock = threading.Lock()

    def convert(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.take(tuple(src.shape), dtype).copy_(src)

    def take(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of `shape` and `dtype` (reused when one came back), lent until give()."""
        with self.lock:
            stack = self.free.get((tuple(shape), dtype))
            buf = stack.pop() if stack else None
        if buf is None:
            buf = torch.empty(shape, dtype=dtype)
        with self.lock:
            self.lent.add(buf.data_ptr())
        return buf

    def give(self, t: torch.Tensor) -> None:
        with self.lock:
            if t.data_ptr() in self.lent:
                self.lent.discard(t.data_ptr())
                self.free.setdefault((tuple(t.shape), t.dtype), []).append(t)
