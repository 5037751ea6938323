"""One decoder layer's decode attention through kv/decode.DecodePath (the engine's call: append, attend, evict),
quantized block vs plain block, alternated in one process; ms medians. Usage: python path_stage.py [GROUP RING]"""
import statistics, sys, time
import torch
from flexh2o.compress import fused_attend
from flexh2o.kv.cache import KVBlock
from flexh2o.kv.decode import DecodePath
from flexh2o.kv.layout import CacheQuant
from flexh2o.kv.policies import FullPolicy
from flexh2o.kv.step_rows import StepRows

GROUP, RING = (int(a) for a in (sys.argv[1:] + ["64", "16"])[:2])
B, P, H, D, S, CALLS = 32, 272, 12, 64, 288, 40
gen = torch.Generator().manual_seed(0)
pk, pv = torch.randn(B, H, P, D, generator=gen), torch.randn(B, H, P, D, generator=gen)
fused_attend.reader()
blocks = {}
for name, quant in (("quant", CacheQuant(4, GROUP, "channel", 8, RING, 4, True)), ("plain", None)):
    blk = KVBlock.empty(B, H, S, D, torch.float32, "cpu", quant)
    if quant is not None:
        blk.calibrate(pk, torch.ones(B, H, P, dtype=torch.bool))
    for t in range(P):
        blk.append(pk[:, :, t], pv[:, :, t], torch.full((B,), t), True)
    blocks[name] = (blk, DecodePath.of(None, None, False, quant is not None))
q, k, v = (torch.randn(B, H, 1, D, generator=gen) for _ in range(3))
cur = torch.full((B,), P)
policy = FullPolicy()
def call(name):
    blk, path = blocks[name]
    path(q, k, v, cur, blk, policy, 0, StepRows(cur.tolist()))
for threads in (torch.get_num_threads(), 1):
    torch.set_num_threads(threads)
    times = {n: [] for n in blocks}
    for _ in range(CALLS):
        for n in blocks:
            t0 = time.perf_counter(); call(n); times[n].append(time.perf_counter() - t0)
    med = {n: statistics.median(x[3:]) for n, x in times.items()}
    print(f"group {GROUP} ring {RING}, batch {B}, {P + 1} slots, {threads} thread(s): " + "; ".join(
        f"{n} {1e3 * m:.2f}" for n, m in med.items()) + f" ms; quant/plain {med['quant'] / med['plain']:.2f}")
