"""How each weight reaches the compute side at each phase: the one rule that the engine's weight loads
(weights/store.py), the memory plan's compute-side buffers and the cost model share.

Under --compress-weight with 4-bit groups along the input dimension on a CPU (`kernel_layout`), weights of a
kernel shape are stored in the int4 kernel's order (compress/kernels.py). Such a weight comes to the compute side
either in the kernel's form (a PackedWeight: its stored bytes plus bf16 scales and zeros) or expanded into the
compute dtype. `kernel` (phase -> bool) says where the decoder blocks' matmuls run the kernel; then
  lookup tables (layer 0's embeddings)  always come in the kernel's form: a lookup expands only the row blocks it reads
  the head's matmuls                    follow decode: the head multiplies one token a sequence at every phase
  every other matmul                    follows its phase.
Every other weight is used in place when it lives on the compute side in the compute dtype, else copied (converted,
or expanded from the codec's order) into the compute dtype.
"""
from __future__ import annotations

import torch

from flexh2o.compress.codec import weight_spec
from flexh2o.compress.kernels import KERNEL_GROUPS, kernel_shape_ok, packed_bytes, rows_buffer_bytes

PHASES = ("prefill", "decode")


def kernel_layout(rc) -> bool:
    """Whether rc's compressed weights of a kernel shape are stored in the int4 kernel's order."""
    cw = rc.compress_weight
    return (cw is not None and cw.group_dim == 1 and cw.bits == 4 and cw.group_size in KERNEL_GROUPS
            and torch.device(rc.device).type == "cpu")


def in_kernel_order(spec, compress, layout: bool) -> bool:
    """Whether the weight `spec` (a WeightSpec) is stored in the kernel's order under `compress`."""
    return layout and kernel_shape_ok(spec.shape, weight_spec(spec.shape, compress))


def is_lookup(layer: int, spec) -> bool:
    """Layer 0's embedding tables: looked up by row, never multiplied."""
    return layer == 0 and "embed" in spec.name


def as_kernel(layer: int, num_layers: int, spec, kernel: dict, phase: str) -> bool:
    """For a weight stored in the kernel's order: whether it comes in the kernel's form at `phase`."""
    if is_lookup(layer, spec):
        return True
    return bool(kernel.get("decode" if layer > num_layers else phase, False))


def planned_kernel(rc) -> dict:
    """phase -> kernel as the memory plan assumes before the engine's probe: with the kernel's layout and
    --weight-kernel auto or int4, the kernel at every phase (the least memory: under auto the engine expands a
    phase instead only where the plan still fits, compress/choice.py); never otherwise."""
    return dict.fromkeys(PHASES, kernel_layout(rc) and rc.weight_kernel != "generic")


def compute_side_bytes(rc, homes, kernel: dict, phase: str) -> tuple:
    """Per layer index: bytes its weights take on the compute side at `phase` apart from their homes (the
    PackedWeights, expanded and converted copies, a lookup's row buffer). homes: a WeightHomes."""
    compute = rc.compute_at(0 if phase == "prefill" else 1)
    key = ("compute_side", rc.dtype, compute, rc.compress_weight, kernel_layout(rc),
           tuple(bool(kernel.get(p)) for p in PHASES), phase)

    def per_layer(h) -> tuple:
        last = len(h.layer_specs) - 2
        return tuple(sum(_weight_bytes(rc, i, last, s, h[s.name], compute, kernel, phase) for s in layer)
                     for i, layer in enumerate(h.layer_specs))
    return homes.derived(key, per_layer)


def _weight_bytes(rc, layer: int, num_layers: int, s, home: str, compute: torch.dtype, kernel: dict,
                  phase: str) -> int:
    spec = weight_spec(s.shape, rc.compress_weight)
    if spec is None:
        return 0 if home == "gpu" and rc.dtype == compute else s.numel * compute.itemsize
    if in_kernel_order(s, rc.compress_weight, kernel_layout(rc)) and as_kernel(layer, num_layers, s, kernel, phase):
        return packed_bytes(s.shape, rc.dtype, spec) + (rows_buffer_bytes(s.shape) if is_lookup(layer, s) else 0)
    return s.numel * compute.itemsize
