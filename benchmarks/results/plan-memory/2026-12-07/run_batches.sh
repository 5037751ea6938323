cd /work/main
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 NUMBA_CPU_NAME=haswell FLEXH2O_CACHE_DIR=/tmp/fx-cache-avx2 OMP_WAIT_POLICY=PASSIVE
echo "start $(date -u) load $(cat /proc/loadavg)"
for M in opt-125m opt-350m; do
C="--model $M --percent 0 10 0 0 100 0 --num-gpu-batches 1 --prompt-len 128 --gen-len 2 --kv-policy h2o --kv-budget 32 --dtype bfloat16 --compute-dtype float32 --gpu-mem 4GB --cpu-mem 400MB --no-warmup"
python benchmarks/plan_memory.py --batches 1,8,64 -- $C --compress-weight --compress-cache
python benchmarks/plan_memory.py --batches 1,8,64 -- $C
done
echo "end $(date -u) load $(cat /proc/loadavg)"
