cd /work/main
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 NUMBA_CPU_NAME=haswell FLEXH2O_CACHE_DIR=/tmp/fx-cache-avx2 OMP_WAIT_POLICY=PASSIVE PLAN_MEMORY_TIMELINE=/tmp/planner/tl5.jsonl
echo "start $(date -u) load $(cat /proc/loadavg) commit $(git rev-parse --short HEAD)"
python benchmarks/plan_memory.py --cap 1342177280 --timeout 270 -- --model opt-1.3b --percent 0 0 0 0 100 0 --gpu-batch-size 58 --num-gpu-batches 4 --prompt-len 128 --gen-len 2 --kv-policy h2o --kv-budget 32 --dtype bfloat16 --compute-dtype float32 --compress-weight --compress-cache --gpu-mem 845245372 --cpu-mem 93916153 --disk-mem 70526877696 --no-warmup
echo "end $(date -u) load $(cat /proc/loadavg)"
