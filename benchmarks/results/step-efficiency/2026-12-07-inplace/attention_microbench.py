import os, time, statistics, sys
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from flexh2o.kv import sdpa as S
from flexh2o.kv import one_query_native as N
b, T, slots, th = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(th)
for dt in (torch.bfloat16, torch.float32):
    q = torch.randn(b, 12, 1, 64).to(dt); K = torch.randn(b, 12, slots, 64).to(dt); V = torch.randn(b, 12, slots, 64).to(dt)
    k, v = K[:, :, :T], V[:, :, :T]
    fns = {"old": S.by_matmuls, "new": N.attend}
    ts = {n: [] for n in fns}
    with torch.inference_mode():
        for r in range(21):
            for n, f in fns.items():
                t = time.perf_counter(); f(q, k, v); ts[n].append(time.perf_counter() - t)
    print(dt, th, "threads", " ".join(f"{n} min {min(ts[n])*1e3:.2f} med {statistics.median(ts[n][3:])*1e3:.2f} ms" for n in fns))
