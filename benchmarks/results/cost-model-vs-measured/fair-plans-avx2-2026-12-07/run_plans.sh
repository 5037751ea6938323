#!/usr/bin/env bash
# The fair search's chosen plans (row 84) run directly under the 1.25 GiB cgroup on the AVX2 path with a profile
# measured now: measured / predicted from each run's own record.
set -u
cd /work/main
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 NUMBA_CPU_NAME=haswell OMP_WAIT_POLICY=PASSIVE FLEXH2O_CACHE_DIR=/tmp/fx-cache-avx2
mkdir -p $FLEXH2O_CACHE_DIR
OUT=/tmp/predcheck
mkdir -p $OUT
exec 9>/tmp/flexh2o-timed.lock; flock 9
echo "start $(date) load $(cat /proc/loadavg) commit $(git rev-parse --short HEAD)"
FULL="--model opt-1.3b --percent 0 0 0 0 100 0 --gpu-batch-size 29 --num-gpu-batches 1 --prompt-len 128 --gen-len 32 --dtype bfloat16 --compute-dtype float32 --gpu-mem 866342859 --cpu-mem 96260318 --disk-mem 75480346624"
H2O="--model opt-1.3b --percent 0 0 0 0 100 0 --gpu-batch-size 32 --num-gpu-batches 2 --prompt-len 128 --gen-len 32 --kv-policy h2o --kv-budget 32 --dtype bfloat16 --compute-dtype float32 --gpu-mem 845245372 --cpu-mem 93916153 --disk-mem 71876743168"
python -m flexh2o.cli $FULL --dry-run 2>&1 | grep -v profiling; python -m flexh2o.cli $H2O --dry-run 2>&1 | grep -v profiling
python - "$FULL" "$H2O" <<'PY'
import sys, json, os, time
sys.path.insert(0, "benchmarks")
from bench_common import _run
env = dict(os.environ)
for rnd in range(int(os.environ.get("ROUNDS", "1"))):
    for name, argv in (("full", sys.argv[1]), ("h2o", sys.argv[2])):
        t = time.time()
        o = _run([sys.executable, "-m", "flexh2o.cli"] + argv.split(), "pred-", 1500, env, int(1.25 * 2**30))
        r = o.record or {}
        p = r.get("predicted") or {}
        print(json.dumps({"round": rnd, "system": name, "status": o.status, "msg": o.message, "wall": round(time.time()-t, 1),
                          "load": os.getloadavg(), "total_tok_s": r.get("throughput") or r.get("total_throughput"),
                          "decode_tok_s": r.get("decode_throughput"), "prefill_s": r.get("prefill_time"),
                          "decode_s": r.get("decode_time"), "predicted": p,
                          "ratios": {k: v for k, v in r.items() if "predicted" in k and k != "predicted"},
                          "efficiency": r.get("efficiency")}), flush=True)
        with open("$OUT/records.jsonl", "a") as f:
            f.write(json.dumps({"system": name, "round": rnd, "record": r}) + "\n")
PY
echo "end $(date) load $(cat /proc/loadavg)"
