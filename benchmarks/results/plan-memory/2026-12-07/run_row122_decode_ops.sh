cd /work/main
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 NUMBA_CPU_NAME=haswell FLEXH2O_CACHE_DIR=/tmp/fx-cache-avx2 OMP_WAIT_POLICY=PASSIVE
echo "start $(date -u) load $(cat /proc/loadavg) commit $(git rev-parse --short HEAD)"
python benchmarks/decode_ops.py --top 14 -- --model opt-1.3b --percent 0 10 0 0 100 0 --gpu-batch-size 64 --num-gpu-batches 1 --prompt-len 32 --gen-len 4 --kv-policy h2o --kv-budget 32 --dtype bfloat16 --compute-dtype float32 --compress-weight --compress-cache --gpu-mem 845245372 --cpu-mem 93916153 --disk-mem 70526877696 --no-warmup --overlap false
echo "end $(date -u) load $(cat /proc/loadavg)"
