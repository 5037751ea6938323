"""The C read of a quantized block (compress/qread_native.py), in each build this CPU runs (AVX-512, AVX2 and the
generic one, whatever torch's own instruction set), equals attention over the block expanded within the fp32 bound
tests/kv/test_kv_fused_decode.py derives (the same terms summed in another order, exp within a few ulp), for the
default scheme's groups of 64 and 32 and exact rings of 16 and 32 tokens, rotated or not, on whole blocks and on a
segment's strided rows and slots; it also agrees with the numba kernel it replaces within the sum of both bounds.
Where no compiler builds it, fused_decode reads by the numba kernel, as before."""
from __future__ import annotations

import pytest
import torch
from test_kv_attend import B, H, S, _block
from test_kv_fused_decode import G, _bounds, _expanded
from test_kv_fused import U

from flexh2o.compress import attend, expand_native, fused_decode, qread_native
from flexh2o.kv.layout import CacheQuant

pytest.importorskip("numba")
pytestmark = pytest.mark.usefixtures("one_thread")

D = 64
TAKEN = [CacheQuant(4, 64, "channel", 8, 16, 4, True), CacheQuant(4, 32, "channel", 8, 32, 4, True),
         CacheQuant(4, 32, "channel", 8, 16, 4, False), CacheQuant(4, 64, "channel", 8, 32, 4, False),
         CacheQuant(4, 64, "channel", 0, 0, 0, True), CacheQuant(4, 32, "channel", 8, 16, 4, True, 8)]


NEEDS = {"AVX512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"),
         "AVX2": ("avx2", "fma", "f16c"), "DEFAULT": ()}  # the CPU flags each build's compiler flags use


def _cpu_flags() -> set:
    with open("/proc/cpuinfo") as f:
        return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))


def _library(isa: str):
    """The build for `isa` (skipped where this CPU lacks its instructions or no compiler builds it)."""
    if not set(NEEDS[isa]) <= _cpu_flags():
        pytest.skip(f"this CPU does not run the {isa} build")
    lib = qread_native.library(isa)
    if lib is None:
        pytest.skip("no C compiler builds the read here (the numba kernel reads: test_no_compiler_...)")
    return lib


def _case(q, cut, seed: int = 5):
    kf, vf = (attend.cut(f, *cut) for f in _block(q, torch.float32, seed=4))
    pos = torch.arange(S).expand(B, H, S).clone()
    pos[1, :, S - 3:] = -1  # as _block's: row 1 holds 3 fewer tokens
    pos = pos[cut[0]:cut[1], :, :cut[2]]
    query = torch.randn(cut[1] - cut[0], H, G, D, generator=torch.Generator().manual_seed(seed)) * 3
    return kf, vf, pos, query


def _bound(query, kf, vf, used: int, outliers: int):
    """test_kv_fused_decode's bound on the output: eps A + E."""
    delta, a, e = _bounds(query, kf, vf, used, outliers)
    return (2.1 * delta + (used + 4) * U) * a + e


@pytest.mark.parametrize("isa", tuple(NEEDS))
@pytest.mark.parametrize("q", TAKEN, ids=lambda q: q.describe())
@pytest.mark.parametrize("cut", [(0, B, S), (1, 3, 17)], ids=["whole", "segment"])
def test_each_build_equals_the_expanded_read(isa, q, cut):
    lib = _library(isa)
    kf, vf, pos, query = _case(q, cut)
    assert fused_decode.fits(kf, vf, query) and fused_decode.native_takes(kf, vf, query, pos)
    want, p = _expanded(query, kf, vf, pos, 2.0)
    got, psum = fused_decode._native(lib, query, kf, vf, pos, 2.0, True)
    bound = _bound(query, kf, vf, cut[2], q.outliers)
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())
    eps = 2.1 * _bounds(query, kf, vf, cut[2], q.outliers)[0] + (cut[2] + 4) * U
    sum_bound = (eps * p).sum(2) + G * U  # test_kv_fused_decode's bound on the summed probabilities
    assert ((psum - p.sum(2)).abs() <= sum_bound).all()


@pytest.mark.parametrize("q", TAKEN[:2], ids=lambda q: q.describe())
def test_the_c_read_agrees_with_the_numba_kernel(q):
    """Each within the bound of the expanded read, so within twice that of each other (and not equal bit for bit:
    the sums run in another order)."""
    kf, vf, pos, query = _case(q, (0, B, S), seed=7)
    lib, kn = fused_decode.native(), fused_decode.kernel()
    if lib is None:
        pytest.skip("no C compiler builds the read here")
    got, _ = fused_decode._native(lib, query, kf, vf, pos, None, False)
    ref, _ = fused_decode._numba(kn, query, kf, vf, pos, None, False)
    assert ((got - ref).abs() <= 2 * _bound(query, kf, vf, S, q.outliers)).all()


def test_forms_the_c_code_does_not_take_go_to_the_numba_kernel():
    """3-bit levels and groups of 16 are the numba kernel's (fits, but not native_takes)."""
    for q in (CacheQuant(3, 64, "channel", 8, 4, 2, True), CacheQuant(4, 16, "channel", 4, 0, 0, False)):
        kf, vf, pos, query = _case(q, (0, B, S))
        assert fused_decode.fits(kf, vf, query) and not fused_decode.native_takes(kf, vf, query, pos)


def test_no_compiler_leaves_the_numba_kernel_reading(monkeypatch):
    """Where the builder finds no compiler (expand_native.built returns None) fused_decode.native() is None and the
    one-call read is the numba kernel's, still within the bound."""
    monkeypatch.setattr(expand_native, "built", lambda *a: None)
    for cached in (qread_native.library, fused_decode.native):
        cached.cache_clear()
    try:
        assert fused_decode.native() is None
        q = TAKEN[0]
        kf, vf, pos, query = _case(q, (0, B, S))
        got, _ = fused_decode.attend(fused_decode.kernel(), query, kf, vf, pos, None, False)
        want, _ = _expanded(query, kf, vf, pos, None)
        assert ((got - want).abs() <= _bound(query, kf, vf, S, q.outliers)).all()
    finally:
        monkeypatch.undo()
        for cached in (qread_native.library, fused_decode.native):
            cached.cache_clear()
