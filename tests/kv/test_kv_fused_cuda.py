"""The fused quantized-cache attention on CUDA (compress/fused_triton.py): logits and value mix equal the expanded
read on the device within test_kv_fused.py's fp32 bound, for every scheme, and the reader takes the Triton path
there. Skipped without a CUDA device or Triton."""
from __future__ import annotations

import pytest
import torch
from test_kv_attend import _block
from test_kv_fused import MORE, U, _magnitude, _rotation_terms

from flexh2o.compress import fused_attend
from flexh2o.compress.codec import expand_stored
from flexh2o.compress.rotation import rotated_if

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
triton_kernels = pytest.importorskip("flexh2o.compress.fused_triton")

B, H, G, D = 3, 2, 2, 64


@pytest.mark.parametrize("q", MORE, ids=lambda q: q.describe())
def test_triton_read_equals_the_expanded_read(q):
    """The bound of test_kv_fused.test_fused_read_equals_the_expanded_read_within_fp32_rounding (the kernels sum
    the same terms in another order)."""
    assert triton_kernels.available("cuda")
    kf, vf = (f.map(lambda t: t.cuda()) for f in _block(q, torch.float32, seed=4))
    query = torch.randn(B, H, G, D, generator=torch.Generator().manual_seed(5)).cuda()
    keys, rk = expand_stored(kf, torch.float32)
    values, _ = expand_stored(vf, torch.float32)
    qs = rotated_if(query, rk)
    want = torch.einsum("bhgd,bhsd->bhgs", qs, keys)
    got = fused_attend.chosen("auto").logits(qs, kf)
    n = q.outliers if q.keys != "token" else 0
    bound = (2 * D + n + 8 + _rotation_terms(q)) * U * 4 * _magnitude(kf) * qs.abs().sum(-1, keepdim=True)
    assert ((got - want).abs() <= bound).all()
    p = torch.softmax(want / 8, -1)
    got_v = fused_attend.chosen("auto").mix(p, vf, torch.float32)
    want_v = torch.einsum("bhgs,bhsd->bhgd", p, values)
    bound = (2 * keys.shape[2] + 8 + _rotation_terms(q)) * U * 2 * _magnitude(vf) * p.sum(-1, keepdim=True)
    assert ((got_v - want_v).abs() <= bound).all()
