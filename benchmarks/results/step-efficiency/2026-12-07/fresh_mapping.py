import os, time, statistics, ctypes
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from flexh2o.storage.freed_memory import return_freed_blocks
return_freed_blocks()
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int); libc.madvise.restype = ctypes.c_int
HUGE = 2 << 20
def huge_empty(*shape):
    t = torch.empty(*shape)
    a = t.data_ptr(); e = a + t.numel() * t.element_size()
    s = (a + HUGE - 1) // HUGE * HUGE; f = e // HUGE * HUGE
    if f > s: assert libc.madvise(s, f - s, 14) == 0
    return t
fns = {"fresh": lambda: torch.empty(128, 50272).fill_(0), "huge": lambda: huge_empty(128, 50272).fill_(0)}
ts = {n: [] for n in fns}
for r in range(15):
    for n, f in fns.items():
        t = time.perf_counter(); f(); ts[n].append(time.perf_counter() - t)
for n in fns: print(n, f"{statistics.median(ts[n][2:])*1e3:.2f} ms", [round(x*1e3,1) for x in ts[n]])
