"""How each weight reaches the compute side at each phase: the one rule that the engine's weight loads
(weights/store.py), the memory plan's compute-side buffers and the cost model share.

Under --compress-weight with 4-bit groups along the input dimension on a CPU (`kernel_layout`), weights of a
kernel shape are stored in the int4 kernel's order (compress/kernels.py). Such a weight comes to the compute side
either as a PackedWeight (its stored bytes plus bf16 scales and zeros; multiplied by the kernel, or expanded a few
row blocks at a time) or expanded whole into the compute dtype. `kernel` (phase -> bool) says where the decoder
blocks' matmuls run the kernel; then (`packed_form`)
  lookup tables (layer 0's embeddings)  always a PackedWeight: a lookup expands only the row blocks it reads
  the head's matmuls                    always a PackedWeight, run by the kernel where decode runs it (the head
                                        multiplies one token a sequence at every phase), else block by block
  every other matmul                    a PackedWeight run by the kernel where its phase runs it, else expanded.
Every other weight is used in place when it lives on the compute side in the compute dtype, else copied (converted,
or expanded from the codec's order) into the compute dtype.

A PackedWeight that runs the kernel needs the kernel's scales and zeros, built from the stored meta at each load
(about 0.2 ms for a 1536 x 576 weight: a decode step of a memory-resident 4-bit model spent a third of its time
there). For the weights the compute side uses in place and the kernel multiplies at decode (`kept_scale_names`) the
run keeps them built instead, a quarter of the stored bytes more per weight, wherever the memory plan has room for
them after everything else (planning/memory_plan.py decides, MemoryPlan.kept_scales).
"""
from __future__ import annotations

from typing import Optional

import torch

from flexh2o.compress.choice import PHASES
from flexh2o.compress.codec import stored_bytes, weight_spec
from flexh2o.compress.kernels import kernel_shape_ok, kernel_spec_ok, packed_bytes, rows_buffer_bytes, scales_bytes
from flexh2o.weights.stored_form import stays_stored, stored_weight_bytes


def kernel_layout(rc) -> bool:
    """Whether rc's compressed weights of a kernel shape are stored in the int4 kernel's order."""
    return kernel_spec_ok(rc.compress_weight) and torch.device(rc.device).type == "cpu"


def in_kernel_order(spec, compress, layout: bool) -> bool:
    """Whether the weight `spec` (a WeightSpec) is stored in the kernel's order under `compress`."""
    return layout and kernel_shape_ok(spec.shape, weight_spec(spec.shape, compress, spec.name))


def is_lookup(layer: int, spec) -> bool:
    """Layer 0's embedding tables: looked up by row, never multiplied."""
    return layer == 0 and "embed" in spec.name


def packed_form(layer: int, num_layers: int, spec, kernel: dict, phase: str) -> Optional[bool]:
    """For a weight stored in the kernel's order, at `phase`: None when it comes expanded whole, else whether its
    PackedWeight runs the kernel (False: lookups, and matmuls expanded block by block)."""
    if is_lookup(layer, spec):
        return False
    if layer > num_layers:
        return bool(kernel.get("decode", False))
    return True if kernel.get(phase, False) else None


def planned_kernel(rc) -> dict:
    """phase -> kernel as the memory plan assumes before the engine's probe: --weight-kernel int4 the kernel at
    every phase; auto room to expand at every phase (the probe may choose that at either phase), so the engine
    never gives up the faster path for memory at a planned batch."""
    return dict.fromkeys(PHASES, kernel_layout(rc) and rc.weight_kernel == "int4")


def least_kernel(rc) -> dict:
    """phase -> kernel taking the least memory this run may use (the kernel wherever --weight-kernel allows)."""
    return dict.fromkeys(PHASES, kernel_layout(rc) and rc.weight_kernel != "generic")


def in_place_homes(rc) -> tuple:
    """The tiers whose plain weights in the compute dtype the compute side uses where they live (no copy): the gpu
    tier, and on a CPU-only run the cpu tier too (both are host memory there and cpu -> gpu is a no-op: the tier's
    load hands back the home tensor, weights/store.py charges nothing)."""
    return ("gpu", "cpu") if torch.device(rc.device).type == "cpu" else ("gpu",)


def compute_side_bytes(rc, homes, kernel: dict, phase: str) -> tuple:
    """Per layer index: bytes its weights take on the compute side at `phase` apart from their homes (the
    PackedWeights and the block buffer of those expanded block by block, expanded and converted copies).
    homes: a WeightHomes."""
    compute = rc.compute_at(0 if phase == "prefill" else 1)
    key = ("compute_side", rc.dtype, compute, rc.compress_weight, kernel_layout(rc),
           tuple(bool(kernel.get(p)) for p in PHASES), phase, in_place_homes(rc))

    def per_layer(h) -> tuple:
        last = len(h.layer_specs) - 2
        return tuple(sum(_weight_bytes(rc, i, last, s, h[s.name], compute, kernel, phase) for s in layer)
                     for i, layer in enumerate(h.layer_specs))
    return homes.derived(key, per_layer)


def _weight_bytes(rc, layer: int, num_layers: int, s, home: str, compute: torch.dtype, kernel: dict,
                  phase: str) -> int:
    spec = weight_spec(s.shape, rc.compress_weight, s.name)
    if spec is None and stays_stored(layer, num_layers, s, rc.dtype, compute, False):  # weights/stored_form.py
        return stored_weight_bytes(layer, s, rc.dtype, compute, home in in_place_homes(rc))
    if spec is None:
        return 0 if home in in_place_homes(rc) and rc.dtype == compute else s.numel * compute.itemsize
    form = packed_form(layer, num_layers, s, kernel, phase)
    if in_kernel_order(s, rc.compress_weight, kernel_layout(rc)) and form is not None:
        if form:  # run by the kernel: with its scales and zeros
            return packed_bytes(s.shape, rc.dtype, spec)
        return stored_bytes(s.shape, rc.dtype, spec) + rows_buffer_bytes(s.shape)  # expanded from the meta
    return s.numel * compute.itemsize


def kept_scale_names(rc, homes, kernel: dict) -> frozenset:
    """Names of the weights whose int4-kernel scales and zeros a run can keep built (module docstring): stored in
    the kernel's order, homed on a tier the compute side uses in place (`in_place_homes`), run by the kernel at
    decode. homes: a WeightHomes; kernel: phase -> the blocks' matmuls run the kernel."""
    key = ("kept_scales", rc.compress_weight, kernel_layout(rc), bool(kernel.get("decode")), in_place_homes(rc))

    def names(h) -> frozenset:
        if not kernel.get("decode") or not kernel_layout(rc):
            return frozenset()
        last = len(h.layer_specs) - 2
        return frozenset(s.name for i, layer in enumerate(h.layer_specs) for s in layer
                         if h[s.name] in in_place_homes(rc) and in_kernel_order(s, rc.compress_weight, True)
                         and packed_form(i, last, s, kernel, "decode") is True)
    return homes.derived(key, names)


def kept_scales_bytes(rc, homes, kernel: dict) -> int:
    """Bytes of the scales and zeros of every weight in `kept_scale_names` (each once)."""
    specs = {s.name: s for layer in homes.layer_specs for s in layer}
    return sum(scales_bytes(specs[n].shape, weight_spec(specs[n].shape, rc.compress_weight, n))
               for n in kept_scale_names(rc, homes, kernel))
