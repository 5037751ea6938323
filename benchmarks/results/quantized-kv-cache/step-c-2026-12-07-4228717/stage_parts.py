"""Split of one layer's decode attention stage (batch B, P slots, opt-125m shape, default scheme): ms medians."""
import statistics, sys, time
import numba, torch
from flexh2o.compress import fused_attend, fused_decode, fused_step
from flexh2o.compress.form import as_form
from flexh2o.kv.cache import KVBlock
from flexh2o.kv.layout import CacheQuant
from flexh2o.kv.sdpa import one_query

B, P, CALLS = 32, 272, 40
H, D, S = 12, 64, 288
gen = torch.Generator().manual_seed(0)
pk, pv = torch.randn(B, H, P, D, generator=gen), torch.randn(B, H, P, D, generator=gen)
fused_attend.reader()
bq = KVBlock.empty(B, H, S, D, torch.float32, "cpu", CacheQuant(4, 64, "channel", 8, 16, 4, True))
bq.calibrate(pk, torch.ones(B, H, P, dtype=torch.bool))
for t in range(P):
    bq.append(pk[:, :, t], pv[:, :, t], torch.full((B,), t), True)
kp, vp = (torch.cat([x, torch.zeros(B, H, 1, D)], 2) for x in (pk, pv))
q, k, v = (torch.randn(B, H, 1, D, generator=gen) for _ in range(3))
cur = torch.full((B,), P)
kn, wk = fused_decode.kernel(), fused_step.kernel()
print("numba threading layer:", numba.threading_layer(), "numba threads", numba.get_num_threads(), "torch", torch.get_num_threads(), torch.__config__.parallel_info().splitlines()[:8])
found = fused_step.parts(bq.k, bq.v, bq.pos, bq.score)
keys, values = (as_form(x).front(P + 1) for x in (bq.k, bq.v))
pos = bq.pos[:, :, :P + 1]
wargs, _ = fused_step.write_args(found, bq.pos, bq.score, k[:, :, 0], v[:, :, 0], cur, True)
rargs, _, _ = fused_decode._read_args(q, keys, values, pos, None, False)

def one_call():
    write, _ = fused_step.write_args(found, bq.pos, bq.score, k[:, :, 0], v[:, :, 0], cur, True)
    fused_decode.step_attend(kn, write, q, keys, values, pos, None, False)
def write_args(): fused_step.write_args(found, bq.pos, bq.score, k[:, :, 0], v[:, :, 0], cur, True)
def read_args(): fused_decode._read_args(q, keys, values, pos, None, False)
def front(): [as_form(x).front(P + 1) for x in (bq.k, bq.v)]
def put_only(): wk.step_put(*wargs)
def read_only(): kn.attend(*rargs)
def read_1thread():
    numba.set_num_threads(1); kn.attend(*rargs); numba.set_num_threads(torch.get_num_threads())
def step_only(): kn.step_attend(*wargs, *rargs)
def plain():
    kp[:, :, P], vp[:, :, P] = k[:, :, 0], v[:, :, 0]
    one_query(q, kp, vp)
def torch_then_numba():  # a torch op on its pool, then numba's region: handoff cost
    torch.mm(torch.ones(64, 64), torch.ones(64, 64)); kn.attend(*rargs)

calls = dict(one_call=one_call, write_args=write_args, read_args=read_args, front=front, put_only=put_only,
             read_only=read_only, read_1thread=read_1thread, step_only=step_only, torch_then_numba=torch_then_numba, plain=plain)
for threads in (torch.get_num_threads(), 1):
    torch.set_num_threads(threads)
    fused_attend._threads(kn)
    times = {name: [] for name in calls}
    for _ in range(CALLS):
        for name, fn in calls.items():
            t0 = time.perf_counter(); fn(); times[name].append(time.perf_counter() - t0)
    print(f"{threads} thread(s): " + "; ".join(f"{n} {1e3 * statistics.median(x[3:]):.3f}" for n, x in times.items()) + " ms")
