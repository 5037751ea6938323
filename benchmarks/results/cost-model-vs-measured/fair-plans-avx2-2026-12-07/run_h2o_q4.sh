#!/usr/bin/env bash
set -u
cd /work/main
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 NUMBA_CPU_NAME=haswell OMP_WAIT_POLICY=PASSIVE FLEXH2O_CACHE_DIR=/tmp/fx-cache-avx2
exec 9>/tmp/flexh2o-timed.lock; flock 9
echo "start $(date) load $(cat /proc/loadavg) commit $(git rev-parse --short HEAD)"
Q4="--model opt-1.3b --percent 0 10 0 0 100 0 --gpu-batch-size ${B:-113} --num-gpu-batches 1 --prompt-len 128 --gen-len 32 --kv-policy h2o --kv-budget 32 --dtype bfloat16 --compute-dtype float32 --compress-weight --compress-cache --gpu-mem 845245372 --cpu-mem 93916153 --disk-mem 70526877696"
python - "$Q4" <<'PY'
import sys, json, os, time
sys.path.insert(0, "benchmarks")
from bench_common import _run
t = time.time()
o = _run([sys.executable, "-m", "flexh2o.cli"] + sys.argv[1].split(), "pred-", 1500, dict(os.environ), int(1.25 * 2**30))
r = o.record or {}
print(json.dumps({"system": "h2o-q4", "status": o.status, "msg": o.message, "wall": round(time.time()-t, 1), "load": os.getloadavg(),
                  "total": r.get("total_throughput"), "prefill_s": r.get("prefill_s"), "decode_s": r.get("decode_s"),
                  "pred": (r.get("predicted") or {}).get("total_throughput"), "mem_cap": r.get("mem_cap")}), flush=True)
with open("$OUT/records.jsonl", "a") as f:
    f.write(json.dumps({"system": "h2o-q4", "round": 0, "record": r}) + "\n")
PY
echo "end $(date) load $(cat /proc/loadavg)"
