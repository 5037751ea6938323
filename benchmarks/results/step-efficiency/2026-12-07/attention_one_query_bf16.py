import os, time, statistics, sys
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch, torch.nn.functional as F
from flexh2o.storage.freed_memory import return_freed_blocks
return_freed_blocks()
b, T, S = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
def oq(q, k, v):
    s = torch.matmul(q, k.transpose(-1, -2)).float().mul_(q.shape[-1] ** -0.5)
    return torch.matmul(s.softmax(-1).to(v.dtype), v)
def chunked(limit):
    def f(q, k, v):
        rows = max(1, limit // (k[0].numel() * k.element_size()))
        if rows >= k.shape[0]: return oq(q, k, v)
        return torch.cat([oq(*p) for p in zip(q.split(rows), k.split(rows), v.split(rows))])
    return f
def chunked_c(limit):
    def f(q, k, v):
        rows = max(1, limit // (k[0].numel() * k.element_size()))
        return torch.cat([oq(a, b.contiguous(), c.contiguous()) for a, b, c in zip(q.split(rows), k.split(rows), v.split(rows))])
    return f
def whole_c(q, k, v): return oq(q, k.contiguous(), v.contiguous())
for dt in (torch.bfloat16,):
    q = torch.randn(b, 12, 1, 64).to(dt); K = torch.randn(b, 12, S, 64).to(dt); V = torch.randn(b, 12, S, 64).to(dt)
    k, v = K[:, :, :T], V[:, :, :T]
    fns = {"sdpa": F.scaled_dot_product_attention, "oq": oq, "ch3M": chunked(3 << 20), "ch1M": chunked(1 << 20), "ch256K": chunked(1 << 18), "cc3M": chunked_c(3<<20), "cc1M": chunked_c(1<<20), "cc512K": chunked_c(1<<19), "whole_c": whole_c}
    ts = {n: [] for n in fns}
    with torch.inference_mode():
        for r in range(11):
            for n, f in fns.items():
                t = time.perf_counter(); f(q, k, v); ts[n].append(time.perf_counter() - t)
    print(dt, " ".join(f"{n} {statistics.median(ts[n][2:])*1e3:.2f}" for n in fns))
