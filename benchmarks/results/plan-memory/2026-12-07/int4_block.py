import time, statistics, torch
from flexh2o.compress.codec import CompressionSpec, quantize
from flexh2o.compress.kernels import PackedWeight, to_kernel_order
from flexh2o.compress import int4_rows
torch.manual_seed(0)
spec = CompressionSpec(4, 64, 1)
h = 2048
shapes = [(h, h)] * 4 + [(4 * h, h), (h, 4 * h)]  # one opt-1.3b block
cts = [to_kernel_order(quantize(torch.randn(*s), spec, torch.bfloat16)) for s in shapes]
flops_per_row = 2 * sum(a * b for a, b in shapes)
for rows in (64,):
    x = {k: torch.randn(rows, k) for k in (h, 4 * h)}
    pre = [PackedWeight.from_stored(ct) for ct in cts]
    print("chosen own product:", int4_rows.chosen(x[h], cts[0].data.view(h, -1), 64))
    def prebuilt():
        for p in pre: p.linear(x[p.packed.shape[1] * 2])
    def per_load():
        for ct in cts:
            p = PackedWeight.from_stored(ct, lazy=True); p.linear(x[p.packed.shape[1] * 2])
    for name, fn in (("prebuilt (the profile's)", prebuilt), ("built per load (the run's)", per_load)):
        fn(); ts = []
        for _ in range(7):
            t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
        m = statistics.median(ts)
        print(f"rows {rows} {name}: {m*1e3:.1f} ms a block, {rows*flops_per_row/m/1e9:.1f} GFLOP/s")
