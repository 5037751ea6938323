"""The fused quantized-cache attention on CUDA: Triton kernels with compress/fused_kernels.py's algebra, reading a
block's packed levels (any of 2, 3, 4, 8 bits) where they lie and dequantizing them in registers, tile by tile.

Used by compress/fused_attend.py for blocks on a CUDA device once `available()` (Triton imports and a self-check on
the device agrees with compress/attend.py's read; decided once a process); never imported on the CPU path. A level
of channel c sits at bit c * bits of its group's bytes, so each tile loads the byte holding it and the next one (3
bits can straddle two) and shifts: no unpacked copy. Arithmetic in fp32. Not yet run on a GPU here (the tests that
check it against the expanded read skip without CUDA: tests/kv/test_kv_fused_cuda.py).
"""
from __future__ import annotations

import functools

import torch

from flexh2o.compress import attend
from flexh2o.compress.channel import ChannelKeys
from flexh2o.compress.codec import CompressedTensor
from flexh2o.compress.form import as_form

BLOCK_S = 32

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the module imports, `available` says no
    triton = tl = None


if triton is not None:  # the kernels (compiled by Triton at their first launch on a device)
    @triton.jit
    def _levels(row, ok, c, size, width, BITS: tl.constexpr):
        """The levels (S, D) fp32 of channels c of the slots whose bytes start at `row` (S, 1), where `ok` (S, D):
        groups of `size` channels, `width` bytes each, one after another."""
        byte = ((c % size) * BITS) // 8
        at = (c // size) * width + byte
        shift = ((c % size) * BITS) % 8
        lo = tl.load(row + at[None, :], mask=ok, other=0).to(tl.int32)
        hi = tl.load(row + at[None, :] + 1, mask=ok & (byte + 1 < width)[None, :], other=0).to(tl.int32)
        return (((lo | (hi << 8)) >> shift[None, :]) & ((1 << BITS) - 1)).to(tl.float32)

    @triton.jit
    def _logits_kernel(q_ptr, data_ptr, sb, sh, st, scale_ptr, lo_ptr, out_ptr, H, G, S, D, groups, width,
                       PER_SLOT: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
        """out[b, h, g, s] = sum_c q[b, h, g, c] (scale lev + lo): scale / lo per (row, head, channel) (keys per
        channel, PER_SLOT False) or per (row, head, slot, group) (PER_SLOT True), fp32 contiguous."""
        r, blk = tl.program_id(0), tl.program_id(1)
        bi, hi = r // H, r % H
        s = blk * BLOCK + tl.arange(0, BLOCK)
        c = tl.arange(0, BLOCK_D)
        s_ok, c_ok = s < S, c < D
        ok = s_ok[:, None] & c_ok[None, :]
        lev = _levels(data_ptr + bi * sb + hi * sh + s[:, None] * st, ok, c, D // groups, width, BITS)
        if PER_SLOT:
            at = ((r * S + s[:, None]) * groups + c[None, :] // (D // groups))
            v = lev * tl.load(scale_ptr + at, mask=ok, other=0.0) + tl.load(lo_ptr + at, mask=ok, other=0.0)
        else:
            v = lev * tl.load(scale_ptr + r * D + c, mask=c_ok, other=0.0)[None, :] + \
                tl.load(lo_ptr + r * D + c, mask=c_ok, other=0.0)[None, :]
        for g in range(G):
            q = tl.load(q_ptr + (r * G + g) * D + c, mask=c_ok, other=0.0)
            tl.store(out_ptr + (r * G + g) * S + s, tl.sum(v * q[None, :], axis=1), mask=s_ok)

    @triton.jit
    def _mix_kernel(p_ptr, sp, data_ptr, sb, sh, st, scale_ptr, lo_ptr, out_ptr, H, G, S, D, groups, width,
                    BITS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
        """out[b, h, g, c] = sum_s p[b, h, g, s] (scale[s, G(c)] lev[s, c] + lo[s, G(c)]); p rows `sp` apart."""
        r, g = tl.program_id(0), tl.program_id(1)
        bi, hi = r // H, r % H
        c = tl.arange(0, BLOCK_D)
        c_ok = c < D
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for s0 in range(0, S, BLOCK):
            s = s0 + tl.arange(0, BLOCK)
            s_ok = s < S
            ok = s_ok[:, None] & c_ok[None, :]
            lev = _levels(data_ptr + bi * sb + hi * sh + s[:, None] * st, ok, c, D // groups, width, BITS)
            at = ((r * S + s[:, None]) * groups + c[None, :] // (D // groups))
            v = lev * tl.load(scale_ptr + at, mask=ok, other=0.0) + tl.load(lo_ptr + at, mask=ok, other=0.0)
            p = tl.load(p_ptr + (r * G + g) * sp + s, mask=s_ok, other=0.0)
            acc += tl.sum(v * p[:, None], axis=0)
        tl.store(out_ptr + (r * G + g) * D + c, acc, mask=c_ok)


class TritonLevels(attend.LevelsRead):
    """The Triton kernels' read of a quantized form's levels, as the form asks for it (compress/form.py: keys per
    channel with evenly spaced levels, values or keys per token in whole groups); the exact ring around its inner
    form's read, a rotated form's inner read and every other form as compress/attend.py reads them."""

    def channel_logits(self, q: torch.Tensor, k: ChannelKeys) -> torch.Tensor:
        scale, lo = (k.calib[..., i].float().contiguous() for i in (0, 1))  # (b, h, d) each
        return _run_logits(q, k.data, scale, lo, 1, k.spec.bits, False) + _outliers(q, k)

    def group_logits(self, q: torch.Tensor, x: CompressedTensor) -> torch.Tensor:
        scale, lo = (x.meta[..., i].float().contiguous() for i in (0, 1))  # (b, h, s, groups) each
        return _run_logits(q, x.data, scale, lo, x.data.shape[3], x.spec.bits, True)

    def group_mix(self, p: torch.Tensor, x: CompressedTensor) -> torch.Tensor:
        scale, lo = (x.meta[..., i].float().contiguous() for i in (0, 1))  # (b, h, s, groups) each
        return _run_mix(p, x.data, scale, lo, x.shape[-1], x.spec.bits)


LEVELS = TritonLevels()  # holds nothing


def logits(q: torch.Tensor, form) -> torch.Tensor:
    """compress/fused_attend.Reader.logits for a block on a CUDA device (the form picks its read of LEVELS)."""
    return as_form(form).logits(q, LEVELS)


def mix32(p: torch.Tensor, form) -> torch.Tensor:
    """The fp32 value mix (compress/fused_attend._mix32) for a block on a CUDA device (the form picks its read)."""
    return as_form(form).mix32(p, LEVELS)


def _slots(data: torch.Tensor) -> torch.Tensor:
    """Packed data whose groups lie one after another within a slot (a copy when they do not)."""
    if data.stride(-1) != 1 or (data.dim() == 5 and data.stride(3) != data.shape[-1]):
        return data.contiguous()
    return data


def _run_mix(p, data, scale, lo, d: int, bits: int) -> torch.Tensor:
    """_mix_kernel's out (b, h, g, d) fp32 for packed data (b, h, s, groups, width) and scale, lo (b, h, s, groups)."""
    b, h, g, s = p.shape
    data, groups = _slots(data), data.shape[3]
    out = torch.empty(b, h, g, d, device=p.device)
    _mix_kernel[(b * h, g)](p.float().contiguous(), s, data, *data.stride()[:3], scale, lo, out, h, g, s, d, groups,
                            data.shape[-1], BITS=bits, BLOCK=BLOCK_S, BLOCK_D=triton.next_power_of_2(d))
    return out


def _run_logits(q, data, scale, lo, groups: int, bits: int, per_slot: bool) -> torch.Tensor:
    b, h, g, d = q.shape
    s = data.shape[2]
    data = _slots(data)
    out = torch.empty(b, h, g, s, device=q.device)
    grid = (b * h, triton.cdiv(s, BLOCK_S))
    _logits_kernel[grid](q.float().contiguous(), data, *data.stride()[:3], scale, lo, out, h, g, s, d, groups,
                         data.shape[-1], PER_SLOT=per_slot, BITS=bits, BLOCK=BLOCK_S,
                         BLOCK_D=triton.next_power_of_2(d))
    return out


def _outliers(q: torch.Tensor, k: ChannelKeys) -> torch.Tensor:
    """Each outlier's (exact - its level's value, the middle one) times q there (b, h, g, s) (compress/attend.py)."""
    if not k.spec.outliers:
        return 0.0
    b, h, s, n = k.index.shape
    scale, lo = k.calib[..., 0].float()[:, :, None], k.calib[..., 1].float()[:, :, None]
    flat = k.index.reshape(b, h, 1, s * n).long()
    delta = k.exact_values().reshape(b, h, 1, s * n) - (lo + (1 << (k.spec.bits - 1)) * scale).gather(-1, flat)
    return (q.float().gather(-1, flat.expand(b, h, q.shape[2], s * n)) * delta).view(b, h, -1, s, n).sum(-1)


@functools.lru_cache(maxsize=8)
def available(device: str) -> bool:
    """Whether the kernels agree with compress/attend.py on a small block on `device` (once a process)."""
    from flexh2o.compress import fused_check
    if triton is None:
        return False
    for bits, keys in ((4, "channel"), (3, "token"), (2, "channel"), (8, "token")):
        x = torch.randn(2, 2, 5, 32)
        k, v = (fused_check.small_form(kind, bits, x).map(lambda t: t.to(device)) for kind in (keys, "token"))
        q, p = torch.randn(2, 2, 3, 32, device=device), torch.softmax(torch.randn(2, 2, 3, 5, device=device), -1)
        for got, want in ((logits(q, k), attend.logits(q, k)), (mix32(p, v), attend.mix(p, v, torch.float32))):
            if not torch.allclose(got, want, rtol=0, atol=1e-4 * (1 + float(want.abs().max()))):
                return False
    return True
