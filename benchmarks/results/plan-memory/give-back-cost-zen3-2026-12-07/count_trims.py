"""flexh2o-run counting FreedMemory.check calls, the give-backs they made and the seconds checking (printed at exit)."""
import sys, time
import flexh2o.storage.freed_memory as fm
n = {"check": 0, "trim": 0, "t": 0.0}
orig_check, orig_give = fm.FreedMemory.check, fm.give_back_freed
def check(self):
    n["check"] += 1
    t = time.perf_counter(); r = orig_check(self); n["t"] += time.perf_counter() - t
    return r
def give():
    n["trim"] += 1
    return orig_give()
fm.FreedMemory.check, fm.give_back_freed = check, give
from flexh2o.cli.run import main
try:
    main()
finally:
    print("checks", n, file=sys.stderr)
