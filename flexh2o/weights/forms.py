"""How each weight of a run is held and reaches the compute side at each phase: `WeightForms`, one frozen value
built once per run (planning/weight_forms.py decides which phases run the int4 kernel) and read by the memory plan,
the weight store (weights/store.py), the engine's buffers and the cost model.

Under --compress-weight with 4-bit groups along the input dimension on a CPU (`kernel_layout`), weights of a
kernel shape are stored in the int4 kernel's order (compress/kernels.py). Such a weight comes to the compute side
either as a PackedWeight (its stored bytes plus bf16 scales and zeros; multiplied by the kernel, or expanded a few
row blocks at a time) or expanded whole into the compute dtype. `WeightForms.kernel` (the phases whose decoder
blocks' matmuls run the kernel) decides which (`WeightForms.form`):
  lookup tables (layer 0's embeddings)  always a PackedWeight: a lookup expands only the row blocks it reads
  the head's matmuls                    always a PackedWeight, run by the kernel where decode runs it (the head
                                        multiplies one token a sequence at every phase), else block by block
  every other matmul                    a PackedWeight run by the kernel where its phase runs it, else expanded.
Every other weight is used in place when it lives on the compute side in the compute dtype, else copied (converted,
or expanded from the codec's order) into the compute dtype; large tables may stay stored (weights/stored_form.py).

A PackedWeight that runs the kernel needs the kernel's scales and zeros, built from the stored meta at each load
(about 0.2 ms for a 1536 x 576 weight: a decode step of a memory-resident 4-bit model spent a third of its time
there), at its first product by torch's kernel (none where compress/int4_rows.py's product runs instead). For the weights the compute side uses in place and the kernel multiplies at decode (`kept_scale_names`) the
run keeps them built instead, a quarter of the stored bytes more per weight, wherever the memory plan has room for
them after everything else (planning/memory_plan.py decides, MemoryPlan.kept_scales).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

import torch

from flexh2o.compress.choice import PHASES
from flexh2o.compress.codec import CompressionSpec, stored_bytes, weight_spec
from flexh2o.compress.kernels import kernel_shape_ok, kernel_spec_ok, packed_bytes, rows_buffer_bytes, scales_bytes
from flexh2o.weights.on_use import chunk_bytes, converts_on_use
from flexh2o.weights.stored_form import read_by_rows, stays_stored, stored_chunk_bytes, stored_weight_bytes

ON_USE_TRIES = (("prefill",), ("decode",), PHASES)  # phases converting on use, tried in turn (fitting_on_use)


def kernel_layout(rc) -> bool:
    """Whether rc's compressed weights of a kernel shape are stored in the int4 kernel's order."""
    return kernel_spec_ok(rc.compress_weight) and torch.device(rc.device).type == "cpu"


def in_kernel_order(spec, compress, layout: bool) -> bool:
    """Whether the weight `spec` (a WeightSpec) is stored in the kernel's order under `compress`."""
    return layout and kernel_shape_ok(spec.shape, weight_spec(spec.shape, compress, spec.name))


def is_lookup(layer: int, spec) -> bool:
    """Layer 0's embedding tables: looked up by row, never multiplied."""
    return layer == 0 and "embed" in spec.name


def in_place_homes(device) -> tuple:
    """The tiers whose plain weights in the compute dtype the compute side uses where they live (no copy): the gpu
    tier, and on a CPU-only run the cpu tier too (both are host memory there and cpu -> gpu is a no-op: the tier's
    load hands back the home tensor, weights/store.py charges nothing)."""
    return ("gpu", "cpu") if torch.device(device).type == "cpu" else ("gpu",)


class WeightForm(NamedTuple):
    """One weight as a run holds it: its stored spec (None: plain), whether it is in the int4 kernel's order, its
    form at each phase of PHASES ("in place", "copied", "stored", "by rows": a stored table read from disk by rows,
    "on use": weights/on_use.py, "expanded", "blocks": a PackedWeight expanded a row block at a time, "kernel"), its
    stored bytes, its compute-side bytes at each phase, the part of them taken only while it multiplies (a chunk
    buffer, read chunks) and the bytes of its int4-kernel scales where they are kept built."""

    spec: Optional[CompressionSpec]
    kernel_order: bool
    forms: tuple
    stored: int
    compute: tuple
    transient: tuple = (0, 0)
    scales: int = 0  # bytes of its int4-kernel scales and zeros where the run keeps them built (in kernel order)


@dataclass(frozen=True)
class WeightForms:
    """How a run's weights are stored and reach the compute side: the storage dtype, each phase's compute dtype
    (prefill, decode), --compress-weight, whether kernel shapes are stored in the int4 kernel's order, the phases
    whose decoder blocks run the kernel, the tiers the compute side uses in place, and the phases whose matmul
    weights are converted on use (weights/on_use.py; CPU runs only)."""

    storage: torch.dtype
    compute: tuple
    compress: Optional[CompressionSpec] = None
    layout: bool = False
    kernel: frozenset = frozenset()
    in_place: tuple = ("gpu",)
    on_use: frozenset = frozenset()

    @staticmethod
    def of_run(rc, kernel=()) -> "WeightForms":
        """rc's forms with the int4 kernel at the phases named in `kernel` (where the layout allows it)."""
        in_place, layout = in_place_homes(rc.device), kernel_layout(rc)
        return WeightForms(rc.dtype, (rc.compute_at(0), rc.compute_at(1)), rc.compress_weight, layout,
                           frozenset(kernel) if layout else frozenset(), in_place)

    @staticmethod
    def planned(rc) -> "WeightForms":
        """The forms the memory plan assumes before the engine's choice: --weight-kernel int4 the kernel at every
        phase; auto room to expand at every phase (the probe may choose that at either phase), so the engine never
        gives up the faster path for memory at a planned batch."""
        return WeightForms.of_run(rc, PHASES if rc.weight_kernel == "int4" else ())

    @staticmethod
    def least(rc) -> "WeightForms":
        """The forms taking the least memory this run may use (the kernel wherever --weight-kernel allows, weights
        converted on use at every phase)."""
        return WeightForms.of_run(rc, () if rc.weight_kernel == "generic" else PHASES).with_on_use(PHASES)

    def with_kernel(self, phases) -> "WeightForms":
        return replace(self, kernel=frozenset(phases) if self.layout else frozenset())

    def with_on_use(self, phases) -> "WeightForms":
        """These forms with the matmul weights converted on use at `phases` (none off a CPU run)."""
        return replace(self, on_use=frozenset(phases) if "cpu" in self.in_place else frozenset())

    def fitting_on_use(self, fits) -> "WeightForms":
        """For forms that do not fit: them converting on use wherever a weight converts when that does not fit
        either (the least memory, for the refusal; tried first: most plans a batch search tries are far over),
        else the first of them converting on use at the phases of ON_USE_TRIES for which fits(forms) holds (each
        use costs a conversion: the fewest phases first); these forms where none converts (or off a CPU run)."""
        tries = [self.with_on_use(p) for p in ON_USE_TRIES
                 if any(self.compute_at(q) != self.storage for q in p) and "cpu" in self.in_place]
        if not tries or not fits(tries[-1]):
            return tries[-1] if tries else self
        return next((f for f in tries[:-1] if fits(f)), tries[-1])

    def runs_kernel(self, phase: str) -> bool:
        return phase in self.kernel

    def kernel_by_phase(self) -> dict:
        """phase -> whether the decoder blocks' matmuls run the int4 kernel (as a run reports it)."""
        return {p: p in self.kernel for p in PHASES}

    def compute_at(self, phase: str) -> torch.dtype:
        return self.compute[PHASES.index(phase)]

    def spec(self, s) -> Optional[CompressionSpec]:
        """How the weight `s` (a WeightSpec) is stored: its compression spec, None when plain."""
        return weight_spec(s.shape, self.compress, s.name)

    def in_kernel_order(self, s) -> bool:
        return in_kernel_order(s, self.compress, self.layout)

    def form(self, layer: int, num_layers: int, s, phase: str) -> Optional[bool]:
        """For a weight stored in the kernel's order, at `phase`: None when it comes expanded whole, else whether
        its PackedWeight runs the kernel (False: lookups, and matmuls expanded block by block)."""
        if is_lookup(layer, s):
            return False
        if layer > num_layers:
            return "decode" in self.kernel
        return True if phase in self.kernel else None

    def weight(self, layer: int, num_layers: int, s, home: str) -> WeightForm:
        """The weight `s` (a WeightSpec) of layer index `layer`, homed on tier `home`, as the run holds it."""
        spec, ordered = self.spec(s), self.in_kernel_order(s)
        at = [self._at(layer, num_layers, s, home, spec, ordered, p) for p in PHASES]
        scales = scales_bytes(s.shape, spec) if ordered else 0
        return WeightForm(spec, ordered, tuple(a[0] for a in at), stored_bytes(tuple(s.shape), self.storage, spec),
                          tuple(a[1] for a in at), tuple(a[2] for a in at), scales)

    def _at(self, layer: int, num_layers: int, s, home: str, spec, ordered: bool, phase: str) -> tuple:
        """(form, compute-side bytes apart from its home, the part of them taken only while it multiplies) of one
        weight at `phase` (the ChunkBuffer of those converted on use is the run's: chunk_buffer_bytes)."""
        compute, in_place = self.compute_at(phase), home in self.in_place
        if spec is None and read_by_rows(layer, num_layers, s, False, home, "cpu" in self.in_place):  # a DiskTable
            return ("by rows", stored_weight_bytes(layer, s, self.storage, compute, False, by_rows=True),
                    stored_chunk_bytes(layer, s, self.storage, compute, by_rows=True))
        stays = spec is None and stays_stored(layer, num_layers, s, self.storage, compute, False)
        if stays:  # stored_form.py
            return ("stored", stored_weight_bytes(layer, s, self.storage, compute, in_place),
                    stored_chunk_bytes(layer, s, self.storage, compute))
        if phase in self.on_use and converts_on_use(layer, s, spec is not None, stays, self.storage, compute):
            return "on use", 0 if in_place else s.numel * self.storage.itemsize, 0  # in place, or as read
        if spec is None:
            in_use = in_place and self.storage == compute
            return ("in place", 0, 0) if in_use else ("copied", s.numel * compute.itemsize, 0)
        form = self.form(layer, num_layers, s, phase) if ordered else None
        if form:  # run by the kernel: with its scales and zeros
            return "kernel", packed_bytes(s.shape, self.storage, spec), 0
        if form is False:  # expanded a row block at a time from the stored meta
            return "blocks", stored_bytes(s.shape, self.storage, spec) + rows_buffer_bytes(s.shape), 0
        return "expanded", s.numel * compute.itemsize, 0

    def table(self, homes) -> tuple:
        """Per layer index, the WeightForm of each of its weights (layer_specs' order). homes: a WeightHomes, which
        keeps the table (a batch search plans one placement many times)."""
        def build(h) -> tuple:
            last = len(h.layer_specs) - 2
            return tuple(tuple(self.weight(i, last, s, h[s.name]) for s in layer)
                         for i, layer in enumerate(h.layer_specs))
        return homes.derived(("weight_forms", self), build)

    def compute_side_bytes(self, homes, phase: str) -> tuple:
        """Per layer index: the most bytes its weights take on the compute side at `phase` apart from their homes
        (the PackedWeights and the block buffer of those expanded block by block, expanded and converted copies,
        and the largest transient of one weight multiplying: one multiplies at a time)."""
        return self._per_layer(homes, phase)[0]

    def transient_bytes(self, homes, phase: str) -> tuple:
        """Per layer index: the part of compute_side_bytes taken only while the layer computes."""
        return self._per_layer(homes, phase)[1]

    def on_use_bytes(self, homes, phase: str) -> tuple:
        """Per layer index: stored bytes of its weights converted on use at `phase` (each use converts them)."""
        return self._per_layer(homes, phase)[2]

    def _per_layer(self, homes, phase: str) -> tuple:
        """(compute_side_bytes, transient_bytes, on_use_bytes) at `phase`, kept on `homes` (a batch search plans
        one placement many times)."""
        def build(h) -> tuple:
            at, rows = PHASES.index(phase), []
            for layer in self.table(h):
                passing = max((w.transient[at] for w in layer), default=0)
                rows.append((sum(w.compute[at] - w.transient[at] for w in layer) + passing, passing,
                             sum(w.stored for w in layer if w.forms[at] == "on use")))
            return tuple(zip(*rows))
        return homes.derived(("per_layer", self, phase), build)

    def streamed_bytes(self, homes, phase: str) -> tuple:
        """(per layer: stored bytes of its plain weights homed on disk, read whole into an arena at each load (not
        the tables read by rows), of those used as read at `phase`: in the compute dtype, kept stored or converted
        on use) (file padding left out), as the run's table of forms says."""
        at, as_read = PHASES.index(phase), self.compute_at(phase) == self.storage

        def build(h) -> tuple:
            size = self.storage.itemsize
            read = [[(s, w) for s, w in zip(layer, forms) if h[s.name] == "disk" and w.spec is None
                     and w.forms[at] != "by rows"] for layer, forms in zip(h.layer_specs, self.table(h))]
            return (tuple(sum(s.numel for s, _ in ws) * size for ws in read),
                    tuple(sum(s.numel for s, w in ws if as_read or w.forms[at] in ("stored", "on use")) * size
                          for ws in read))
        return homes.derived(("streamed", self, phase), build)

    def expanded_read_bytes(self, homes, phase: str) -> tuple:
        """Per layer: stored bytes of its compressed weights homed on disk that come expanded whole at `phase`. A
        load reads them all at once into fresh buffers (weights/store.py `_read_compressed`), held until it ends."""
        at = PHASES.index(phase)
        return homes.derived(("expanded_reads", self, phase), lambda h: tuple(
            sum(w.stored for s, w in zip(layer, forms) if h[s.name] == "disk" and w.spec is not None
                and w.forms[at] == "expanded") for layer, forms in zip(h.layer_specs, self.table(h))))

    def chunk_buffer_bytes(self, homes) -> int:
        """Bytes of the run's one ChunkBuffer (weights/on_use.py): the largest chunk a weight converted on use
        takes at any phase (0 when none is)."""
        def build(h) -> int:
            return max((chunk_bytes(s, self.compute_at(p)) for layer, forms in zip(h.layer_specs, self.table(h))
                        for s, w in zip(layer, forms) for i, p in enumerate(PHASES) if w.forms[i] == "on use"),
                       default=0)
        return homes.derived(("chunk_buffer", self), build) if self.on_use else 0

    def kept_scale_names(self, homes) -> frozenset:
        """Names of the weights whose int4-kernel scales and zeros a run can keep built (module docstring): stored
        in the kernel's order, homed on a tier the compute side uses in place, run by the kernel at decode."""
        at = PHASES.index("decode")
        return homes.derived(("kept_scales", self), lambda h: frozenset(
            s.name for layer, forms in zip(h.layer_specs, self.table(h)) for s, w in zip(layer, forms)
            if h[s.name] in self.in_place and w.kernel_order and w.forms[at] == "kernel"))

    def kept_scales_bytes(self, homes) -> int:
        """Bytes of the scales and zeros of every weight in `kept_scale_names` (each once)."""
        names = self.kept_scale_names(homes)
        return sum({s.name: w.scales for layer, forms in zip(homes.layer_specs, self.table(homes))
                    for s, w in zip(layer, forms) if s.name in names}.values())
