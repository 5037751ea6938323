"""The C expansion of kernel-order 4-bit weights (compress/expand_native.py) against the codec's dequantize.

Both compute each value as (level as fp32) * scale + minimum with two fp32 roundings and no fused multiply-add,
then one round to nearest even into bf16 or fp16 where asked, so the results must be equal bit for bit (tolerance 0).
"""
import shutil

import pytest
import torch

from flexh2o.compress import expand_native, int4_order, kernels
from flexh2o.compress.codec import CompressionSpec, dequantize, quantize
from flexh2o.compress.kernels import PackedWeight, expand_kernel_order, native_expands, to_kernel_order

needs_build = pytest.mark.skipif(not expand_native.available(), reason="no C compiler: the torch path is used")


def _weight(rows: int, cols: int, group: int, seed: int, meta_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    ct = quantize(torch.randn(rows, cols, generator=g) * 0.05, CompressionSpec(4, group, 1), meta_dtype)
    return ct, to_kernel_order(ct)


@needs_build
@pytest.mark.parametrize("order", int4_order.ROW_ORDERS)
@pytest.mark.parametrize("rows", [32, 64, 96, 160])
@pytest.mark.parametrize("group", kernels.KERNEL_GROUPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_expansion_is_dequantize_bit_for_bit(monkeypatch, order, rows, group, dtype):
    """Each order torch may write (whole blocks of 32 or 64 rows, a last block of 32 rows in pairs), every kernel
    grouping, fp32, bf16 and fp16 out (where the compiler has _Float16): equal to dequantize then the conversion.
    The generic build's order (every block in pairs) is not the C expansion's: the torch path expands it."""
    if dtype not in expand_native.out_dtypes():
        pytest.skip(f"this compiler has no {dtype}")
    monkeypatch.setattr(int4_order, "torch_order", lambda: order)
    ct, ko = _weight(rows, 512, group, rows * order.block + group + order.paired)
    want = dequantize(ct, torch.float32).to(dtype)
    if not order.paired:
        got = torch.full((rows, 512), float("nan"), dtype=dtype)  # every value must be written
        expand_native.expand_into(ko.data, ko.meta, group, order.block, got)
        assert torch.equal(got, want)
    assert native_expands(group, dtype) == (not order.paired)
    assert torch.equal(expand_kernel_order(ko, torch.empty(rows, 512, dtype=dtype)), want)


@needs_build
@pytest.mark.parametrize("meta_dtype", [torch.float16, torch.float32])
def test_native_expansion_reads_any_meta_dtype(meta_dtype):
    """Scales and minimums stored as fp16 or fp32 (a checkpoint's kept blocks) are read as fp32, as dequantize."""
    ct, ko = _weight(128, 256, 32, 7, meta_dtype)
    got = expand_kernel_order(ko, torch.empty(128, 256, dtype=torch.bfloat16))
    assert torch.equal(got, dequantize(ct, torch.float32).to(torch.bfloat16))


@needs_build
def test_block_by_block_linear_expands_straight_into_bf16(monkeypatch):
    """A PackedWeight multiplied block by block in bf16 (kernel False) uses bf16 buffers and gives the generic
    path's result exactly: the same bf16 weights, the same matmul of the same row blocks."""
    monkeypatch.setattr(kernels, "ROWS_ELEMENTS", 1 << 30)  # one chunk: the same matmul as the reference's
    ct, ko = _weight(160, 192, 64, 3)
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    got = PackedWeight.from_stored(ko, torch.bfloat16, kernel=False).linear(x)
    want = x @ dequantize(ct, torch.float32).to(torch.bfloat16).t()
    assert torch.equal(got, want)


def test_without_a_compiler_the_torch_path_expands(monkeypatch, tmp_path):
    """No usable compiler: nothing is built, `available` is False, and expand_kernel_order still equals dequantize
    (the torch path) for fp32, bf16 and fp16 out."""
    monkeypatch.setenv("FLEXH2O_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    expand_native._library.cache_clear()
    try:
        assert not expand_native.available()
        assert not native_expands(64, torch.float32)
        ct, ko = _weight(96, 128, 64, 5)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            got = expand_kernel_order(ko, torch.empty(96, 128, dtype=dtype))
            assert torch.equal(got, dequantize(ct, torch.float32).to(dtype))
        assert not list(tmp_path.rglob("*.so"))
    finally:
        expand_native._library.cache_clear()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_build_goes_to_the_cache_directory_once(monkeypatch, tmp_path):
    """Built once into $FLEXH2O_CACHE_DIR/native, named by instruction set and source, no temporary left."""
    monkeypatch.setenv("FLEXH2O_CACHE_DIR", str(tmp_path))
    expand_native._library.cache_clear()
    try:
        assert expand_native.available()
        built = list((tmp_path / "native").iterdir())
        isa = torch.backends.cpu.get_cpu_capability().lower()
        assert len(built) == 1 and built[0].name.startswith(f"expand4-{isa}-") and built[0].suffix == ".so"
    finally:
        expand_native._library.cache_clear()


def _torch_scales(meta: torch.Tensor) -> torch.Tensor:
    """The int4 kernel's scales and zeros as torch ops compute them (kernels.kernel_scales' fallback)."""
    m = meta.to(torch.float32).clone()
    m[..., 1].add_(m[..., 0], alpha=8)
    return m.to(torch.bfloat16).transpose(0, 1).contiguous()  # (groups, N, 2)


@needs_build
@pytest.mark.parametrize("meta_dtype", expand_native.META_DTYPES)
@pytest.mark.parametrize("rows, groups", [(32, 1), (96, 4), (1024, 16), (160, 64)])
def test_native_scales_are_the_torch_ones_bit_for_bit(meta_dtype, rows, groups):
    """scales_into and kernel_scales against the torch ops: scale rounded to bf16, minimum + 8 scale in fp32 (8 scale
    exact, one rounding) then rounded to nearest even, so equal bit for bit (tolerance 0); scales spanning 2^-30..2^30
    and minimums of either sign, zeros and a constant group's 0 scale included."""
    g = torch.Generator().manual_seed(rows + groups)
    meta = torch.randn(rows, groups, 2, generator=g) * torch.exp2(torch.randint(-30, 31, (rows, groups, 2),
                                                                                  generator=g).float())
    meta[0, 0] = torch.tensor([0.0, -1.5])
    meta = meta.to(meta_dtype)
    out = torch.full((groups, rows, 2), float("nan"), dtype=torch.bfloat16)  # every value must be written
    assert expand_native.scales_into(meta, out)
    want = _torch_scales(meta)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert torch.equal(kernels.kernel_scales(meta).view(torch.int16), want.view(torch.int16))


def test_scales_of_other_meta_or_without_a_compiler_come_from_torch(monkeypatch, tmp_path):
    """fp16 meta (not read by the C code), and any meta where nothing is built: kernel_scales is the torch ops'."""
    meta = torch.randn(64, 8, 2, generator=torch.Generator().manual_seed(3))
    half = meta.to(torch.float16)
    assert not expand_native.scales_into(half, torch.empty(8, 64, 2, dtype=torch.bfloat16))
    assert torch.equal(kernels.kernel_scales(half), _torch_scales(half))
    monkeypatch.setenv("FLEXH2O_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    expand_native._library.cache_clear()
    try:
        assert not expand_native.scales_into(meta, torch.empty(8, 64, 2, dtype=torch.bfloat16))
        assert torch.equal(kernels.kernel_scales(meta), _torch_scales(meta))
    finally:
        expand_native._library.cache_clear()
