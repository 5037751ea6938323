#!/bin/bash
# Zen 3, 2026-12-07: what giving freed memory back after each prefill layer and once a decode step costs (A: the
# working tree with storage/freed_memory.FreedMemory; B: a worktree of f0f226d, before it), alternated by
# farm-bench: memory-resident opt-125m (row 139's command, full cache) and disk-streamed opt-350m 4-bit (row 140's)
set -u
export OMP_WAIT_POLICY=PASSIVE
D=$(pwd)
BASE=/tmp/wt-base  # git worktree add /tmp/wt-base f0f226d
S=/work/main/benchmarks/results/quantized-kv-cache/same-batch-zen3-2026-12-07-498ea3c/summ.py
M="python -m flexh2o.cli.run --model opt-125m --percent 100 0 100 0 --num-gpu-batches 1 --dtype float32 --compute-dtype float32 --prompt-len 256 --gen-len 32 --gpu-batch-size 32"
Q="python -m flexh2o.cli.run --model opt-350m --percent 0 0 100 0 --gpu-batch-size 16 --prompt-len 128 --gen-len 16 --compress-weight --compress-cache"
for name in mem disk; do
  C=$M; [ $name = disk ] && C=$Q
  (date; uptime) >> $D/$name.uptime
  farm-bench -n 3 --warmup 0 --timeout 900 \
    --vs "sh -c 'cd $BASE && exec $C --log-file $D/$name.B.jsonl >> $D/$name.B.txt 2>&1'" \
    -- sh -c "cd /work/main && exec $C --log-file $D/$name.A.jsonl >> $D/$name.A.txt 2>&1" > $D/$name.pairs.txt 2>&1
  (date; uptime) >> $D/$name.uptime
done
python $S $D mem disk > $D/summary.txt
