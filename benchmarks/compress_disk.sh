#!/bin/bash
# Disk-streamed weights, full and h2o 20%, each with and without --compress-weight --compress-cache, each at its
# largest batch under the same caps; alternating, one JSON record per run appended to $1.
#   OMP_WAIT_POLICY=PASSIVE bash benchmarks/compress_disk.sh benchmarks/results/compress_disk.jsonl
set -euo pipefail
LOG=${1:-benchmarks/results/compress_disk.jsonl}
MODEL=${MODEL:-opt-1.3b}
COMMON=(--model "$MODEL" --percent 0 0 100 0 --dtype bfloat16 --compute-dtype float32 --prompt-len 128 --gen-len 4
        --gpu-batch-size auto --gpu-mem "${GPU_MEM:-1GB}" --cpu-mem 2GB --offload-dir "${OFFLOAD:-/tmp/cmp-off}"
        --no-warmup --log-file "$LOG")
mkdir -p "$(dirname "$LOG")"
uptime >> "${LOG%.jsonl}.uptime"
for policy in "" "--hh-ratio 0.2"; do
  for comp in "" "--compress-weight --compress-cache"; do
    echo "== $policy $comp" >&2
    # shellcheck disable=SC2086
    flexh2o-run "${COMMON[@]}" $policy $comp | grep -E "^(policy|decode|total|moved)"
  done
done
uptime >> "${LOG%.jsonl}.uptime"
