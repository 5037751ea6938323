"""A decode step's attention over a quantized block in C (compress/qread_c.py): compress/fused_decode.py's one-call
read (the numba kernel's arithmetic) where the stored form allows it, with one C call a layer and segment; where
the rows hold their tokens in order, each (row, KV head) pair's new token is written by the same call first
(compress/qwrite_c.py: the numba write's bytes, bit for bit), as the numba kernel's step_attend did.

The numba kernel's loops over a slot's 32 packed bytes ran at about 46 ns a slot and pair on a Zen 4 core (keys,
outliers, softmax and values together), against the plain cache's C attention's 29 ns over 512 bytes of fp32: the
C loops, vectorised by the compiler for the build's instruction set, read the same bytes in a fraction of that.

Built once per machine, source and instruction set into the cache directory with the system's C compiler
(compress/expand_native.py's `built`), the instruction set following torch's own (ATEN_CPU_CAPABILITY: AVX-512,
AVX2, or the generic build under `default`), as compress/expand_native.py's. It takes 4-bit keys per channel and
4-bit values in groups of a multiple of 32 channels, head dimension a multiple of 32 up to MAXD (`takes`); checked
once a process against the torch levels read on a small block (compress/fused_decode.py's `native`). Where no compiler builds it
`library()` is None and the numba kernel reads as before.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from flexh2o.compress import expand_native

FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno")  # no reassociation, no
# contraction: the write's roundings are the numba kernel's (the read's sums are reassociated by its intrinsics)
MAXD = 256  # the C code's largest head dimension
I64, F32, PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
SIZES = ("b", "h", "g", "d", "used", "n_out", "groups", "ek", "ev", "rot", "idx16", "want")
PARTS = (("q", 0), ("hm", 0), ("kdata", 3), ("kidx", 3), ("kexact", 3), ("calib", 2), ("vdata", 3), ("meta", 3),
         ("pos", 2), ("rk", 3), ("sk", 2), ("rv", 3), ("sv", 2), ("psum", 0), ("out", 0))  # (name, strides)


WSIZES = ("b", "h", "d", "slots", "n_out", "groups", "ek", "ev", "kbits", "vbits", "in_order", "rotk", "rotv", "idx16",
          "kwin", "ksink", "vwin", "vsink")
WPARTS = (("k", 0), ("v", 0), ("cur", 0), ("hm", 0), ("pos", 3), ("score", 3), ("slot", 0), ("kdata", 3), ("kidx", 3),
          ("kexact", 3), ("calib", 2), ("vdata", 3), ("vmeta", 3), ("krs", 2), ("krec", 3), ("vrs", 2), ("vrec", 3))
STEP_NAMES = ("k", "v", "cur", "in_order", "hm", "rotk", "hv", "rotv", "pos", "score", "slot", "kdata", "kidx",
              "kexact", "calib", "kbits", "vdata", "vmeta", "vbits", "krs", "krec", "kwin", "ksink", "vrs", "vrec",
              "vwin", "vsink")  # compress/fused_step.py's write_args, in order


def _pointers(parts: tuple) -> list:
    """An argument block's fields of `parts` ((name, strides) pairs): each part's pointer, then its leading strides."""
    return [f for name, k in parts for f in [(name, PTR)] + [(f"{name}{i}", I64) for i in range(k)]]


class QWrite(ctypes.Structure):
    """The C write's argument block (qwrite_c.py's QWrite), as QRead's."""

    _fields_ = [(n, I64) for n in WSIZES] + _pointers(WPARTS)


class QRead(ctypes.Structure):
    """The C code's argument block (qread_c.py's QRead): sizes, the scale and cap, each part's pointer and its
    leading strides in elements."""

    _fields_ = [(n, I64) for n in SIZES] + [("inv", F32), ("cap", F32)] + _pointers(PARTS)


@functools.lru_cache(maxsize=None)
def library(isa: Optional[str] = None) -> Optional[ctypes.CDLL]:
    """The library built for torch's instruction set (or `isa`), None where it cannot be built or loaded."""
    isa = isa or torch.backends.cpu.get_cpu_capability()
    from flexh2o.compress.qread_c import SOURCE
    flags = [*FLAGS, *dict(expand_native.ISA_FLAGS).get(isa, ())]
    lib = expand_native.built(f"qread-{isa.lower()}", SOURCE, flags)
    if lib is None or (lib.qread_struct_size(), lib.qwrite_struct_size()) != tuple(map(ctypes.sizeof, (QRead, QWrite))):
        return None
    lib.qread.restype = lib.qstep.restype = ctypes.c_int
    lib.qread.argtypes = [ctypes.POINTER(QRead), ctypes.c_int]
    lib.qstep.argtypes = [ctypes.POINTER(QWrite), ctypes.POINTER(QRead), ctypes.c_int]
    return lib


def takes(k, v, d: int) -> bool:
    """Whether the C code reads keys k (ChannelKeys) and values v (CompressedTensor) of head dimension d."""
    size = v.spec.group_size
    return (k.spec.bits == 4 and v.spec.bits == 4 and d % 32 == 0 and d <= MAXD and size % 32 == 0
            and d % size == 0 and k.index.dtype in (torch.uint8, torch.int16) and v.meta.dtype == torch.float32
            and k.calib.dtype == torch.float32)


def _part(t: torch.Tensor, lead: int, keep: list) -> tuple:
    """(t's data pointer, its first `lead` strides), t made contiguous past them where it is not (kept alive)."""
    inner = t if lead == 0 or t.numel() == 0 else t[(0,) * lead]
    if not inner.is_contiguous():
        t = t.contiguous()
    keep.append(t)
    return (t.data_ptr(),) + tuple(t.stride()[:lead])


def _fields(parts: dict, names: tuple, keep: list) -> dict:
    """Each part's pointer and leading strides as the argument block's fields."""
    fields = {}
    for name, lead in names:
        got = _part(parts[name], lead, keep)
        fields[name] = got[0]
        fields.update({f"{name}{i}": s for i, s in enumerate(got[1:])})
    return fields


def write_block(write: tuple, keep: list) -> Optional[QWrite]:
    """compress/fused_step.py's write_args (numpy arrays, a step_put's) as the C write's argument block; None where
    its 8-bit or 16-bit levels' widths are not whole bytes a slot."""
    w = {n: (torch.from_numpy(x) if hasattr(x, "dtype") else x) for n, x in zip(STEP_NAMES, write)}
    b, h, d = w["k"].shape
    if (d * w["kbits"]) % 8 or (d // w["vmeta"].shape[3] * w["vbits"]) % 8:
        return None
    sizes = dict(b=b, h=h, d=d, slots=w["pos"].shape[2], n_out=w["kidx"].shape[3], groups=w["vmeta"].shape[3],
                 ek=w["krs"].shape[2], ev=w["vrs"].shape[2], kbits=w["kbits"], vbits=w["vbits"],
                 in_order=int(w["in_order"]), rotk=int(w["rotk"]), rotv=int(w["rotv"]),
                 idx16=int(w["kidx"].dtype == torch.int16), kwin=w["kwin"], ksink=w["ksink"], vwin=w["vwin"],
                 vsink=w["vsink"])
    return QWrite(**sizes, **_fields(w, WPARTS, keep))


def read(lib, parts: dict, sizes: dict, inv: float, cap: float, write: Optional[tuple] = None) -> None:
    """Run the C read (after the C write of `write`, fused_step.write_args, where given): parts, name -> tensor
    (PARTS' names; psum and out written), sizes, SIZES' names -> ints."""
    keep = []
    arg = QRead(**sizes, inv=inv, cap=cap, **_fields(parts, PARTS, keep))
    block = write_block(write, keep) if write is not None else None
    if write is not None and block is None:
        raise ValueError("quantized step: the write's levels are not whole bytes a slot")
    threads = torch.get_num_threads()
    got = lib.qstep(ctypes.byref(block), ctypes.byref(arg), threads) if block else lib.qread(ctypes.byref(arg), threads)
    if got:
        raise ValueError(f"quantized read: head dimension {sizes['d']} in {sizes['groups']} value groups is not one "
                         f"the C code takes")


def attend(lib, q: torch.Tensor, k, v, rings: tuple, hm: torch.Tensor, pos: torch.Tensor, softcap,
           want: bool, write: Optional[tuple] = None) -> tuple:
    """q (b, h, g, d) fp32 contiguous, model basis; k: ChannelKeys and v: CompressedTensor cut to `used` slots
    (`takes`), rings (rk (b, h, E, d), sk (b, h, E) int32, rv, sv) the exact rings' entries and slots (E may be 0),
    hm the rotation (H) or None (not rotated), pos (b, h, >= used) -> (out (b, h, g, d) fp32, model basis;
    psum (b, h, used) fp32 when want, else None). write: fused_step.write_args' arguments, written first (`read`)."""
    b, h, g, d = q.shape
    used = k.data.shape[2]
    psum, out = torch.empty(b, h, used if want else 0), torch.empty(b, h, g, d)
    rk, sk, rv, sv = rings
    parts = dict(q=q, hm=hm if hm is not None else q, kdata=k.data, kidx=k.index, kexact=k.exact_values(),
                 calib=k.calib, vdata=v.data, meta=v.meta, pos=pos, rk=rk, sk=sk, rv=rv, sv=sv, psum=psum, out=out)
    sizes = dict(b=b, h=h, g=g, d=d, used=used, n_out=k.index.shape[3], groups=v.meta.shape[3], ek=sk.shape[2],
                 ev=sv.shape[2], rot=int(hm is not None), idx16=int(k.index.dtype == torch.int16), want=int(want))
    read(lib, parts, sizes, d ** -0.5, float(softcap or 0.0), write)
    return out, (psum if want else None)
