#!/bin/bash
# run.sh's memory-resident pair again with the order reversed (B first in each pair: f0f226d, then the working tree)
set -u
export OMP_WAIT_POLICY=PASSIVE
D=$(pwd)
BASE=/tmp/wt-base
M="python -m flexh2o.cli.run --model opt-125m --percent 100 0 100 0 --num-gpu-batches 1 --dtype float32 --compute-dtype float32 --prompt-len 256 --gen-len 32 --gpu-batch-size 32"
(date; uptime) >> $D/memrev.uptime
farm-bench -n 3 --warmup 0 --timeout 900 \
  --vs "sh -c 'cd /work/main && exec $M --log-file $D/memrev.B.jsonl >> $D/memrev.B.txt 2>&1'" \
  -- sh -c "cd $BASE && exec $M --log-file $D/memrev.A.jsonl >> $D/memrev.A.txt 2>&1" > $D/memrev.pairs.txt 2>&1
(date; uptime) >> $D/memrev.uptime
python /work/main/benchmarks/results/quantized-kv-cache/same-batch-zen3-2026-12-07-498ea3c/summ.py $D memrev >> $D/summary.txt
