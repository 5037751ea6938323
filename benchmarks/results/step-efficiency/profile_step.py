"""Profile decode steps of a memory-resident run: ops grouped by name+shape, per step."""
import sys, time, argparse, collections
sys.path.insert(0, "benchmarks")  # run from the repository root
import torch
from torch.profiler import profile, ProfilerActivity
from flexh2o.engine import Engine
from resident import add_flags, prompts_and_config
ap = argparse.ArgumentParser(); add_flags(ap, 32); ap.add_argument("--gen-len", type=int, default=8)
ap.add_argument("--top", type=int, default=40)
args = ap.parse_args()
prompts, rc = prompts_and_config(args, [100, 0, 100, 0, 100, 0], args.gen_len)
prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
state = {}
def on_step(step):
    if step == 0:
        prof.start(); state["t0"] = time.perf_counter()
    elif step == args.gen_len - 1:
        state["t1"] = time.perf_counter(); prof.stop()
with Engine(rc) as eng:
    eng.generate(prompts, 2)
    g0 = eng.generate(prompts, args.gen_len)
    print(f"unprofiled decode step {g0.decode_s/(args.gen_len-1)*1e3:.1f} ms")
    g = eng.generate(prompts, args.gen_len, on_step=on_step)
n = args.gen_len - 1
wall = (state["t1"] - state["t0"]) / n
print(f"profiled step {wall*1e3:.1f} ms")
ka = prof.key_averages(group_by_input_shape=True)
rows = sorted(ka, key=lambda e: -e.self_cpu_time_total)
tot = sum(e.self_cpu_time_total for e in ka) / n / 1e3
print(f"self time of all ops per step {tot:.1f} ms")
bycat = collections.Counter()
for e in rows:
    bycat[e.key] += e.self_cpu_time_total / n / 1e3
print("by op:", ", ".join(f"{k} {v:.1f}" for k, v in bycat.most_common(20)))
for e in rows[:args.top]:
    print(f"{e.self_cpu_time_total/n/1e3:8.2f} ms  x{e.count/n:5.1f}  {e.key:28s} {str(e.input_shapes)[:110]}")
