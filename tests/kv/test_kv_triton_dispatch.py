"""compress/fused_triton.py's read, on the CPU without Triton: each form picks its read (keys per channel with evenly
spaced levels and whole groups by the kernels, fitted keys expanded, the exact ring and the rotation around their
inner form's read) and hands the kernels its levels, scales, minimums and outliers. Torch references of the two
kernels' contracts stand in for the Triton launches, so the read equals the expanded read within
test_kv_fused.py's fp32 bound for every scheme of MORE, and each launch is the one the form's scheme asks for. The
kernels themselves run in tests/kv/test_kv_fused_cuda.py (on a CUDA device)."""
from __future__ import annotations

import pytest
import torch
from test_kv_attend import _block
from test_kv_fused import MORE, U, _magnitude, _rotation_terms

from flexh2o.compress import fused_triton
from flexh2o.compress.bits import unpack
from flexh2o.compress.codec import expand_stored
from flexh2o.compress.rotation import rotated_if

B, H, G, D = 3, 2, 2, 64  # test_kv_attend's blocks: B rows, H KV heads, head_dim D; G queries a KV head


def _values(data: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """What the kernels read (b, h, s, d) fp32: levels of channel c at bit c * bits of its group's bytes, times the
    scale plus the minimum, per channel (scale, lo (b, h, d); data (b, h, s, bytes)) or per slot and group (scale, lo
    (b, h, s, groups); data (b, h, s, groups, width))."""
    grouped = data if data.dim() == 5 else data.unsqueeze(3)
    lev = unpack(grouped, bits, d // grouped.shape[3]).reshape(*grouped.shape[:3], d).float()
    if scale.dim() == 3:  # per channel
        return lev * scale[:, :, None] + lo[:, :, None]
    n = d // scale.shape[-1]
    return lev * scale.repeat_interleave(n, -1) + lo.repeat_interleave(n, -1)


@pytest.fixture
def launches(monkeypatch):
    """The kernels' contracts in torch in place of the Triton launches; each launch recorded (kernel, per slot)."""
    seen = []

    def run_logits(q, data, scale, lo, groups, bits, per_slot):
        assert groups == (data.shape[3] if per_slot else 1) and scale.dim() == (4 if per_slot else 3)
        seen.append(("logits", per_slot))
        return torch.einsum("bhgd,bhsd->bhgs", q.float(), _values(data, scale, lo, bits, q.shape[-1]))

    def run_mix(p, data, scale, lo, d, bits):
        seen.append(("mix", True))
        return torch.einsum("bhgs,bhsd->bhgd", p.float(), _values(data, scale, lo, bits, d))

    monkeypatch.setattr(fused_triton, "_run_logits", run_logits)
    monkeypatch.setattr(fused_triton, "_run_mix", run_mix)
    return seen


def test_the_module_imports_without_triton():
    assert fused_triton.triton is None or fused_triton.triton.__name__ == "triton"
    if fused_triton.triton is None:
        assert not fused_triton.available("cuda")


@pytest.mark.parametrize("q", MORE, ids=lambda q: q.describe())
def test_each_form_picks_its_read(q, launches):
    """test_kv_fused_cuda's check (the same bound: the kernels sum the same terms in another order), with the
    launches each scheme asks for: keys per channel one per-channel logits launch (fitted levels: none, read
    expanded), keys per token one per-slot launch; values one mix launch."""
    kf, vf = _block(q, torch.float32, seed=4)
    query = torch.randn(B, H, G, D, generator=torch.Generator().manual_seed(5))
    keys, rk = expand_stored(kf, torch.float32)
    values, _ = expand_stored(vf, torch.float32)
    qs = rotated_if(query, rk)
    want = torch.einsum("bhgd,bhsd->bhgs", qs, keys)
    got = fused_triton.logits(qs, kf)
    n = q.outliers if q.keys != "token" else 0
    bound = (2 * D + n + 8 + _rotation_terms(q)) * U * 4 * _magnitude(kf) * qs.abs().sum(-1, keepdim=True)
    assert ((got - want).abs() <= bound).all()
    assert launches == {"token": [("logits", True)], "channel": [("logits", False)], "fitted": []}[q.keys]
    launches.clear()
    p = torch.softmax(want / 8, -1)
    got_v = fused_triton.mix32(p, vf)
    want_v = torch.einsum("bhgs,bhsd->bhgd", p, values)
    bound = (2 * keys.shape[2] + 8 + _rotation_terms(q)) * U * 2 * _magnitude(vf) * p.sum(-1, keepdim=True)
    assert ((got_v - want_v).abs() <= bound).all()
    assert launches == [("mix", True)]


def test_a_plain_or_ragged_form_is_read_as_attend_reads_it(launches):
    """No launch for a plain block or groups with a ragged tail: compress/attend.py's read."""
    from flexh2o.compress import attend
    from flexh2o.compress.codec import CacheGroupSpec, quantize
    x = torch.randn(B, H, 5, 40, generator=torch.Generator().manual_seed(6))
    q = torch.randn(B, H, G, 40, generator=torch.Generator().manual_seed(7))
    ragged = quantize(x, CacheGroupSpec(4, 16, -1))  # 40 channels: groups of 16, 16 and 8
    for form in (x, ragged):
        assert torch.equal(fused_triton.logits(q, form), attend.logits(q, form))
    p = torch.softmax(torch.randn(B, H, G, 5), -1)
    assert torch.equal(fused_triton.mix32(p, ragged), attend.mix(p, ragged, torch.float32))
    assert launches == []
