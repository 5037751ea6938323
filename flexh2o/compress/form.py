"""CacheForm: how one K or V of a KV cache block is held, and all that the cache and attention do with it.

One implementation per scheme, each beside its spec (a FormSpec: the parts it stores, and the form built from them):
  plain               `Plain` / `PlainSpec` (here): the tensor itself (b, h, slots, d) in the storage dtype
  grouped             compress/codec.py's CompressedTensor / CacheGroupSpec: FlexGen's groups along head_dim
  per-channel keys    compress/channel.py's ChannelKeys / ChannelSpec: scales calibrated on the prompt, outliers
  rotated             compress/rotation.py's Rotated / RotatedSpec: another form, holding its tokens times H
  the exact ring      compress/recent.py's Recent / RingSpec: another form, its newest and first tokens kept exact
kv/layout.py's CacheQuant says which spec K and V take (`CacheQuant.form_spec`); a new scheme is its file (spec and
form) and its field there. A block keeps a plain K or V as the torch.Tensor itself; `as_form` is the one place that
tells a tensor from a form. `read` (logits, mix) is a levels reader: compress/attend.py's (torch) or a fused one
(compress/fused_attend.py, compress/fused_triton.py), which a quantized form asks for the read of its own levels
(`channel_logits`, `group_logits`, `group_mix`); a form with no such read is read expanded. Likewise a form asks the
write kernels (compress/fused_write.py) for its own write (`kernel_assign`).
"""
from __future__ import annotations

from typing import Callable

import torch


class CacheForm:
    """A K or V of a block, (b, h, slots, head_dim), in some stored form (module docstring). Slots are dimension 2:
    `index` (assign, append) selects (row, head, slot) as tensors or slices, one slot being written alone."""

    quantized = True  # its slots hold levels, not the values (Plain: False)
    rotated = False  # it holds its tokens times H (read it with a rotated query; rotate the output back)

    # ---- what it holds --------------------------------------------------------------------------------------
    def tensors(self) -> dict:
        """Its stored parts, name -> tensor, as its spec names them (FormSpec.form_parts)."""
        raise NotImplementedError

    def map(self, fn: Callable) -> "CacheForm":
        """fn applied to every part (indexing of rows or heads, .to(device))."""
        raise NotImplementedError

    def front(self, n: int) -> "CacheForm":
        """The first n slots of every row."""
        raise NotImplementedError

    def held(self):
        """What a KVBlock keeps of it: the form itself (Plain: its tensor)."""
        return self

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def cut(self, r0: int, r1: int, used: int) -> "CacheForm":
        """Rows r0:r1 and the first `used` slots (a decode segment's)."""
        rows = self if (r0, r1) == (0, self.shape[0]) else self.map(lambda t: t[r0:r1])
        return rows.front(used)

    # ---- writing --------------------------------------------------------------------------------------------
    def assign(self, index: tuple, values: torch.Tensor) -> None:
        """self[index] = values (..., d), in any float dtype: stored (quantized) as the form holds them."""
        raise NotImplementedError

    def append(self, index: tuple, slot: torch.Tensor, pos: torch.Tensor, values: torch.Tensor) -> None:
        """A decode step's new token of every row (values (b, h, d), pos (b,)) into `slot` (b, h) at `index`."""
        self.assign(index, values)

    def kernel_assign(self, index: tuple, values: torch.Tensor, write) -> bool:
        """self[index] = values by the write kernels' routine for this scheme, as `write` (compress/fused_write.py's
        KernelWrite) offers them (`channel_assign`, `group_assign`): True when written, False where the form has
        none or it does not run (the caller assigns)."""
        return False

    def step_parts(self):
        """What compress/fused_step.py's one-call write of a decode step takes of this form: (its levels form,
        "channel" or "group", whether rotated, its exact ring's (rslot, entries, window, sinks) or None), decided by
        the form's own scheme; None where the call does not take it (the form writes itself)."""
        return None

    def calibrate(self, k: torch.Tensor, valid: torch.Tensor) -> None:
        """Prefill, before any token is written: scales from the prompt's tokens k (b, h, t, d) marked in valid."""

    def remember_prompt(self, pos: torch.Tensor, values: torch.Tensor) -> None:
        """Prefill packed a prompt's kept tokens (values (b, h, m, d)) at positions pos (b, h, m) into the first
        slots (a form keeping some of them exact takes them here)."""

    # ---- reading --------------------------------------------------------------------------------------------
    def expanded(self, dtype: torch.dtype) -> torch.Tensor:
        """The values (b, h, slots, d) in `dtype`, in the model's basis."""
        raise NotImplementedError

    def expanded_stored(self, dtype: torch.dtype) -> tuple:
        """(the values (b, h, slots, d) in `dtype` in the basis the form stores, whether that basis is rotated)."""
        return self.expanded(dtype), False

    def logits(self, q: torch.Tensor, read) -> torch.Tensor:
        """q (b, h, g, d) in the compute dtype and the form's stored basis -> q . k of every slot (b, h, g, slots)
        fp32 (read expanded unless the form has a levels read)."""
        return torch.einsum("bhgd,bhsd->bhgs", q, self.expanded_stored(q.dtype)[0]).float()

    def mix(self, p: torch.Tensor, dtype: torch.dtype, read) -> torch.Tensor:
        """p (b, h, g, slots) fp32 -> sum over slots of p v (b, h, g, d) in `dtype`, in the stored basis; a quantized
        form's products in fp32 (`mix32`)."""
        return self.mix32(p, read).to(dtype)

    def mix32(self, p: torch.Tensor, read) -> torch.Tensor:
        """The fp32 value mix (mix's arithmetic for a quantized form)."""
        return torch.einsum("bhgs,bhsd->bhgd", p, self.expanded_stored(torch.float32)[0])


class Plain(CacheForm):
    """A plain K or V: the tensor (b, h, slots, d) in the storage dtype, wrapped only while it is worked on."""

    quantized = False

    def __init__(self, t: torch.Tensor):
        self.t = t

    @property
    def shape(self) -> tuple:
        return tuple(self.t.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.t.dtype

    def tensors(self) -> dict:
        return {"": self.t}

    def map(self, fn: Callable) -> "Plain":
        return Plain(fn(self.t))

    def front(self, n: int) -> "Plain":
        return self if n == self.t.shape[2] else Plain(self.t[:, :, :n])

    def held(self) -> torch.Tensor:
        return self.t

    def assign(self, index: tuple, values: torch.Tensor) -> None:
        self.t[index] = values.to(self.t.dtype)

    def expanded(self, dtype: torch.dtype) -> torch.Tensor:
        return self.t.to(dtype)

    def logits(self, q: torch.Tensor, read) -> torch.Tensor:
        return torch.einsum("bhgd,bhsd->bhgs", q, self.t).float()

    def mix(self, p: torch.Tensor, dtype: torch.dtype, read) -> torch.Tensor:
        return torch.einsum("bhgs,bhsd->bhgd", p.to(dtype), self.t)


class PlainSpec:
    """The spec of a plain K or V: one tensor, written slot by slot."""

    def form_parts(self, shape: tuple, dtype: torch.dtype) -> dict:
        """name -> (shape, dtype, per slot) of each stored part of a K or V of `shape` (b, h, slots, d)."""
        return {"": (tuple(shape), dtype, True)}

    def build(self, tensors: dict, shape: tuple) -> torch.Tensor:
        """The block's K or V from its parts (a plain one is the tensor itself)."""
        return tensors[""]


PLAIN = PlainSpec()


def as_form(x) -> CacheForm:
    """A block's K or V as a CacheForm (a plain tensor wrapped)."""
    return x if isinstance(x, CacheForm) else Plain(x)
