import os, sys, time, statistics
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, "/tmp/bf16s/nb")
import torch, torch.nn.functional as F
from flexh2o.storage.freed_memory import return_freed_blocks
return_freed_blocks()
from flexh2o.kv.sdpa import one_query
import kern2, numba
numba.set_num_threads(torch.get_num_threads())
b, T, S = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dt = torch.bfloat16
q = torch.randn(b, 12, 1, 64).to(dt); K = torch.randn(b, 12, S, 64).to(dt); V = torch.randn(b, 12, S, 64).to(dt)
k, v = K[:, :, :T], V[:, :, :T]
def flat(x):
    span = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()))
    return x.view(torch.int16).as_strided((span,), (1,)).numpy().view(np.uint16), np.array(x.stride()[:3], np.int64)
import numpy as np
def nb(q, k, v):
    out = torch.empty(q.shape[0], q.shape[1], q.shape[3])
    kf, ks = flat(k); vf, vs = flat(v)
    kern2.attend16(q[:, :, 0].float().contiguous().numpy(), kf, ks, vf, vs, k.shape[2], q.shape[-1] ** -0.5, out.numpy())
    return out[:, :, None].to(q.dtype)
t0 = time.perf_counter(); nb(q, k, v); print("first call", time.perf_counter() - t0)
ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
for n, f in (("sdpa", F.scaled_dot_product_attention), ("one_query", one_query), ("numba", nb)):
    print(n, (f(q, k, v).double() - ref).abs().max().item())
fns = {"sdpa": F.scaled_dot_product_attention, "one_query": one_query, "numba": nb}
ts = {n: [] for n in fns}
for r in range(11):
    for n, f in fns.items():
        t = time.perf_counter(); f(q, k, v); ts[n].append(time.perf_counter() - t)
print(b, T, S, " ".join(f"{n} {statistics.median(ts[n][2:])*1e3:.2f}" for n in fns))
