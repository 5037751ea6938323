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
there). For the weights the compute side uses in place and the kernel multiplies at decode (`kept_scale_names`) the
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
from flexh2o.weights.stored_form import read_by_rows, stays_stored, stored_weight_bytes


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
    form at each phase of PHASES ("in place", "converted", "stored", "expanded", "blocks": a PackedWeight expanded
    a row block at a time, "kernel"), its stored bytes and its compute-side bytes at each phase."""

    spec: Optional[CompressionSpec]
    kernel_order: bool
    forms: tuple
    stored: int
    compute: tuple


@dataclass(frozen=True)
class WeightForms:
    """How a run's weights are stored and reach the compute side: the storage dtype, each phase's compute dtype
    (prefill, decode), --compress-weight, whether kernel shapes are stored in the int4 kernel's order, the phases
    whose decoder blocks run the kernel, and the tiers the compute side uses in place."""

    storage: torch.dtype
    compute: tuple
    compress: Optional[CompressionSpec] = None
    layout: bool = False
    kernel: frozenset = frozenset()
    in_place: tuple = ("gpu",)

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
        """The forms taking the least memory this run may use (the kernel wherever --weight-kernel allows)."""
        return WeightForms.of_run(rc, () if rc.weight_kernel == "generic" else PHASES)

    def with_kernel(self, phases) -> "WeightForms":
        return replace(self, kernel=frozenset(phases) if self.layout else frozenset())

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
        return WeightForm(spec, ordered, tuple(f for f, _ in at), stored_bytes(tuple(s.shape), self.storage, spec),
                          tuple(b for _, b in at))

    def _at(self, layer: int, num_layers: int, s, home: str, spec, ordered: bool, phase: str) -> tuple:
        """(form, compute-side bytes apart from its home) of one weight at `phase`."""
        compute, in_place = self.compute_at(phase), home in self.in_place
        if spec is None and read_by_rows(layer, num_layers, s, False, home, "cpu" in self.in_place):  # a DiskTable
            return "stored", stored_weight_bytes(layer, s, self.storage, compute, False, by_rows=True)
        if spec is None and stays_stored(layer, num_layers, s, self.storage, compute, False):
            return "stored", stored_weight_bytes(layer, s, self.storage, compute, in_place)  # stored_form.py
        if spec is None:
            return ("in place", 0) if in_place and self.storage == compute else ("copied", s.numel * compute.itemsize)
        form = self.form(layer, num_layers, s, phase) if ordered else None
        if form:  # run by the kernel: with its scales and zeros
            return "kernel", packed_bytes(s.shape, self.storage, spec)
        if form is False:  # expanded a row block at a time from the stored meta
            return "blocks", stored_bytes(s.shape, self.storage, spec) + rows_buffer_bytes(s.shape)
        return "expanded", s.numel * compute.itemsize

    def table(self, homes) -> tuple:
        """Per layer index, the WeightForm of each of its weights (layer_specs' order). homes: a WeightHomes, which
        keeps the table (a batch search plans one placement many times)."""
        def build(h) -> tuple:
            last = len(h.layer_specs) - 2
            return tuple(tuple(self.weight(i, last, s, h[s.name]) for s in layer)
                         for i, layer in enumerate(h.layer_specs))
        return homes.derived(("weight_forms", self), build)

    def compute_side_bytes(self, homes, phase: str) -> tuple:
        """Per layer index: bytes its weights take on the compute side at `phase` apart from their homes (the
        PackedWeights and the block buffer of those expanded block by block, expanded and converted copies)."""
        at = PHASES.index(phase)
        return tuple(sum(w.compute[at] for w in layer) for layer in self.table(homes))

    def kept_scale_names(self, homes) -> frozenset:
        """Names of the weights whose int4-kernel scales and zeros a run can keep built (module docstring): stored
        in the kernel's order, homed on a tier the compute side uses in place, run by the kernel at decode."""
        at = PHASES.index("decode")
        return frozenset(s.name for layer, forms in zip(homes.layer_specs, self.table(homes))
                         for s, w in zip(layer, forms)
                         if homes[s.name] in self.in_place and w.kernel_order and w.forms[at] == "kernel")

    def kept_scales_bytes(self, homes) -> int:
        """Bytes of the scales and zeros of every weight in `kept_scale_names` (each once)."""
        specs = {s.name: s for layer in homes.layer_specs for s in layer}
        return sum(scales_bytes(specs[n].shape, self.spec(specs[n])) for n in self.kept_scale_names(homes))
