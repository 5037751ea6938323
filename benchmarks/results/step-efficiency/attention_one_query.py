import time, torch, torch.nn.functional as F, sys
B, n, d = 64, 12, 64
def tm(fs, rep=21):
    ts = {k: [] for k in fs}
    for r in range(rep + 2):
        for k, f in fs.items():
            s = time.perf_counter(); f(); e = time.perf_counter() - s
            if r >= 2: ts[k].append(e)
    return {k: sorted(v)[rep // 2] * 1e3 for k, v in ts.items()}
with torch.inference_mode():
    for T in (40, 288):
        q = torch.randn(B, n, 1, d); k = torch.randn(B, n, T, d); v = torch.randn(B, n, T, d)
        def mm():
            s = torch.matmul(q, k.transpose(-1, -2)).mul_(d ** -0.5)
            return torch.matmul(s.softmax(-1), v)
        def bmm():
            s = torch.baddbmm(torch.empty(B * n, 1, T), q.view(B * n, 1, d), k.view(B * n, T, d).transpose(1, 2), beta=0, alpha=d ** -0.5)
            return torch.bmm(torch.softmax(s, -1), v.view(B * n, T, d)).view(B, n, 1, d)
        ref = F.scaled_dot_product_attention(q, k, v)
        print(T, "diff mm", (mm() - ref).abs().max().item(), "bmm", (bmm() - ref).abs().max().item())
        print(T, {k: round(v, 3) for k, v in tm(dict(sdpa=lambda: F.scaled_dot_product_attention(q, k, v), mm=mm, bmm=bmm)).items()}, "ms")
