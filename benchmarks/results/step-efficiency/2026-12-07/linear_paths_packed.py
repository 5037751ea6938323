"""bf16 products at a decode step's rows, alternated call by call: F.linear, oneDNN's linear, oneDNN's linear on a weight packed once
ahead (torch.ops.mkldnn._reorder_linear_weight). python linear_paths_packed.py ROWS bfloat16 (under the timed lock)."""
import os, statistics, time, sys
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch, torch.nn.functional as F
from flexh2o.storage.freed_memory import return_freed_blocks
return_freed_blocks()
rows = int(sys.argv[1]); dt = getattr(torch, sys.argv[2])
SH = ((768, 768), (3072, 768), (768, 3072), (50272, 768), (1024, 1024), (4096, 1024), (1024, 4096))
calls = {}
P = torch.ops.mkldnn._linear_pointwise
for o, i in SH:
    w, x, b = torch.randn(o, i).to(dt), torch.randn(rows, i).to(dt), torch.randn(o).to(dt)
    wp = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    fl = 2.0*rows*o*i
    calls[f"{o}x{i}", "F.linear"] = (fl, lambda x=x, w=w, b=b: F.linear(x, w, b))
    calls[f"{o}x{i}", "oneDNN"] = (fl, lambda x=x, w=w, b=b: P(x, w, b, "none", [], ""))
    calls[f"{o}x{i}", "packed"] = (fl, lambda x=x, w=wp, b=b: P(x, w, b, "none", [], ""))
times = {k: [] for k in calls}
with torch.inference_mode():
    for r in range(11):
        for k, (_, fn) in calls.items():
            t = time.perf_counter(); fn()
            if r >= 2: times[k].append(time.perf_counter() - t)
line = {}
for (s, p), ts in times.items():
    line.setdefault(s, []).append(f"{p} {calls[s,p][0]/statistics.median(ts)/1e9:.0f}")
print(f"rows {rows} {dt}")
for s, v in line.items(): print(s, " | ".join(v))
