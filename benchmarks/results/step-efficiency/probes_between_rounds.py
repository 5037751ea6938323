import sys, time, statistics
sys.path.insert(0, "benchmarks")
import step_efficiency as se
from flexh2o.engine import Engine
import argparse
ap = argparse.ArgumentParser(); se.add_flags(ap, 32); args = ap.parse_args(["--batch", "64"])
prompts, rc = se.prompts_and_config(args, [100, 0, 100, 0, 100, 0], 8)
with Engine(rc) as eng:
    eng.generate(prompts, 2)
    for what in ("none", "none", "probe", "none", "shapes", "none", "probe+shapes", "none"):
        if what != "none":
            t = time.perf_counter()
            if "probe" in what: se.probe_rates(rc.compute)
            if "shapes" in what: se.shapes_rate(rc)
            print(f"  ran {what} {time.perf_counter() - t:.1f} s", flush=True)
        s = se.decode_steps(eng, prompts, 8)
        print(f"after {what:12s}: steps ms " + " ".join(f"{x*1e3:.0f}" for x in s) + f"  mean {statistics.fmean(s)*1e3:.1f}", flush=True)
