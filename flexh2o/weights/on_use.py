"""Weights converted on use: a layer's matmul weights handed to the compute side in their stored dtype and converted
into the compute dtype a chunk of rows at a time, right before each chunk is multiplied, into one buffer the run
reuses (`ChunkBuffer`), instead of the whole layer converted at its load.

Why: with bf16 storage and fp32 compute, two decoder layers in flight converted whole cost twice a layer in fp32
beside the read arenas of the streamed ones (opt-1.3b: 2 x 192 MiB + 2 x 96 MiB), and a tight memory cap then
forced a 2-byte compute dtype that an AVX2 CPU multiplies 10-100x slower. Converted on use, the two layers in flight
cost their stored bytes (used where they live, or as read into an arena) and one chunk's compute-side copy.

Why this design: the weight store hands the layer an `OnUseWeight` (a models.common.StoredWeight, which
models.common.linear already multiplies by chunks), so the model families stay unaware of it (they call linear, as
for any weight) and the schedule is unchanged; a chunked schedule of ops would have put weight parts into the
plan of every family's layer. The cost: a weight is converted at each use (every GPU batch and prefill sub-batch)
rather than once a load, which the cost model prices (tuning/step_cost.py), so WeightForms.on_use turns it on only
for the phases where the whole layer converted at its load does not fit (weights/forms.py, `fitting_on_use`).
Chunks of STORED_CHUNK_BYTES (8 MiB) stay in the CPU's caches between the conversion and the matmul (measured on
the AVX2 path: fc1 of opt-1.3b at 32 rows, 43 ms in chunks against 62 ms converted whole first). Each output is
the same dot product as one call on the converted weight, up to the order of its sum (tests/weights/test_on_use.py).
CPU runs only: on CUDA a layer crosses to the device at its load anyway, and converting it there is one device
pass.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from flexh2o.models import common


def converts_on_use(layer: int, spec, compressed: bool, stays: bool, storage: torch.dtype,
                    compute: torch.dtype) -> bool:
    """Whether weight `spec` of layer index `layer` is converted on use where its phase converts on use: a plain
    (not --compress-weight) matrix that is multiplied (not layer 0's lookup tables), stored in another dtype than
    the phase computes in, and not kept stored already (stays: weights/stored_form.stays_stored)."""
    lookup = layer == 0 and "embed" in spec.name
    return not compressed and not stays and not lookup and len(spec.shape) == 2 and storage != compute


def chunk_bytes(spec, compute: torch.dtype) -> int:
    """Bytes of the compute-dtype chunk one matmul of weight `spec` (N, K) converts at a time."""
    n, k = spec.shape
    return min(n, common.stored_chunk_rows(k, compute)) * k * compute.itemsize


class ChunkBuffer:
    """The one buffer of `nbytes` that OnUseWeights convert their chunks into, made at its first use (`charge`d
    then: the compute side's memory) and lent to one matmul at a time; a matmul that finds it lent (none in a run:
    one layer computes at a time) gets a buffer of its own."""

    def __init__(self, nbytes: int, charge=None):
        self.nbytes, self.charge = nbytes, charge
        self.buf = None
        self.lent = False
        self.lock = threading.Lock()

    @contextmanager
    def rows(self, n: int, k: int, dtype: torch.dtype, device):
        """An (n, k) buffer in `dtype` for the duration of a `with` block."""
        need = n * k * dtype.itemsize
        with self.lock:
            mine = not self.lent and need <= self.nbytes
            if mine:
                self.lent = True
                if self.buf is None:
                    self.buf = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
                    if self.charge is not None:
                        self.charge(self.nbytes)
        try:
            yield (self.buf[:need].view(dtype).view(n, k) if mine
                   else torch.empty(n, k, dtype=dtype, device=device))
        finally:
            if mine:
                with self.lock:
                    self.lent = False


@dataclass(frozen=True)
class OnUseWeight(common.StoredWeight):
    """A matmul weight in its stored dtype (`stored`: its home tensor or a read arena's view), converted into the
    compute dtype `dtype` a chunk of rows at a time in the run's ChunkBuffer as it is multiplied."""

    chunks: ChunkBuffer = None

    def linear(self, x: torch.Tensor, bias=None) -> torch.Tensor:
        """x (..., K) -> x @ W.T + bias (..., N) in x's dtype, chunk by chunk as StoredWeight.linear (a weight of one
        chunk or less: converted whole into the buffer, then multiplied as a plain weight)."""
        n, k = self.stored.shape
        step = common.stored_chunk_rows(k, x.dtype)
        with self.chunks.rows(min(n, step), k, x.dtype, x.device) as buf:  # (rows of a chunk, K)
            if n <= step:  # one chunk: the very product of the weight converted whole
                return common.linear(x, buf.copy_(self.stored), bias)
            flat = x.reshape(-1, k)  # (r, K)
            out = torch.empty(flat.shape[0], n, dtype=x.dtype, device=x.device)  # (r, N)
            for start in range(0, n, step):
                stop = min(n, start + step)
                w = buf[:stop - start].copy_(self.stored[start:stop])  # (chunk, K)
                out[:, start:stop] = common.linear(flat, w, None if bias is None else bias[start:stop])
        return out.view(*x.shape[:-1], n)


def uses_a_step(rc, layer: int, prefill: bool) -> int:
    """Times a step converts a weight of layer index `layer` converted on use: once per GPU batch, in a decoder
    layer's prefill once per sub-batch of rc.prefill_rows() sequences (generation/compute.py). Not counted: an MLP
    weight once more per models.common.rowwise chunk past the first, only where one sub-batch's rows exceed a chunk
    (on a CPU run a sub-batch stays under 4 MiB a buffer, so only prompts of thousands of tokens do)."""
    sub = prefill and 1 <= layer <= rc.model.num_layers
    return rc.num_gpu_batches * (-(-rc.gpu_batch_size // rc.prefill_rows()) if sub else 1)


def reconverted_bytes(rc, forms, layer: int, prefill: bool) -> int:
    """Stored bytes of layer `layer`'s weights converted on use under `forms` (a WeightForms) that a step converts
    beyond the once a layer load of weights converted whole (the cost model's figure)."""
    phase = "prefill" if prefill else "decode"
    return (uses_a_step(rc, layer, prefill) - 1) * forms.on_use_bytes(rc.placement.weights, phase)[layer]
