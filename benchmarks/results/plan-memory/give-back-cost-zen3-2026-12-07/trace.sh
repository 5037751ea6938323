#!/bin/bash
# the 35-sequence h2o-q4 plan of ../allocator-zen3-2026-12-07-f0f226d/ traced by its rss_smaps.py (no TRIM_AFTER)
A="--model opt-1.3b --percent 0 0 0 0 100 0 --gpu-batch-size 35 --num-gpu-batches 1 --prompt-len 128 --gen-len 4 --kv-policy h2o --kv-budget 32 --compute-dtype float32 --compress-weight --compress-cache --gpu-mem 588578028 --cpu-mem 65397559 --no-warmup"
OMP_WAIT_POLICY=PASSIVE python ../allocator-zen3-2026-12-07-f0f226d/rss_smaps.py $A > g4-rule.txt 2>&1
