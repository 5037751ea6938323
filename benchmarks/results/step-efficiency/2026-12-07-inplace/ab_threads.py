import sys, time, argparse, statistics, os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, "benchmarks")
import torch
from flexh2o.engine import Engine
from flexh2o.kv import one_query_native as N
from resident import add_flags, prompts_and_config
ap = argparse.ArgumentParser(); add_flags(ap, 32); ap.add_argument("--gen-len", type=int, default=8)
ap.add_argument("--rounds", type=int, default=4)
args = ap.parse_args()
prompts, rc = prompts_and_config(args, [100, 0, 100, 0, 100, 0], args.gen_len)
acc = [0.0]
def mk(threads):
    def attend(q, k, v):
        t0 = time.perf_counter()
        b, h, g, d = q.shape; t = k.shape[-2]
        k, v = (x.expand(b, h, t, d) for x in (k, v))
        out = torch.empty(b, h, g, d, dtype=q.dtype)
        N._library().one_query(N.DTYPES.index(q.dtype), b, h, g, t, d, q.data_ptr(), *q.stride()[:3], k.data_ptr(), *k.stride()[:3], v.data_ptr(), *v.stride()[:3], out.data_ptr(), d ** -0.5, threads or torch.get_num_threads())
        acc[0] += time.perf_counter() - t0
        return out
    return attend
paths = {"t2": mk(0), "t1": mk(1)}
res = {n: [] for n in paths}
with Engine(rc) as eng:
    eng.generate(prompts, 2)
    for r in range(args.rounds):
        for n in (paths if r % 2 == 0 else list(paths)[::-1]):
            N.attend = paths[n]; ends = []; 
            def on(s):
                ends.append(time.perf_counter())
                if s == 0: acc[0] = 0.0
            eng.generate(prompts, args.gen_len, on_step=on)
            st = statistics.fmean(b - a for a, b in zip(ends, ends[1:]))
            res[n].append((st, acc[0] / (args.gen_len - 1)))
            print(r, n, f"step {st*1e3:.1f} ms attention {acc[0]/(args.gen_len-1)*1e3:.1f} ms", flush=True)
