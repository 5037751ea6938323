#!/bin/bash
# usage: bench.sh NAME "EXTRA FLAGS" (env from the caller); runs in $TREE, writes $OUT/NAME.*
NAME=$1; EXTRA=$2
cd $TREE
R="python -m flexh2o.cli.run --model opt-125m --percent 100 0 100 0 --num-gpu-batches 1 --dtype float32 --compute-dtype float32 --prompt-len 256 --gen-len 32 --gpu-batch-size 32 $EXTRA"
O=$OUT/$NAME
rm -f $O.A.jsonl $O.B.jsonl
(date -u; uptime) > $O.uptime
OMP_WAIT_POLICY=PASSIVE flock /tmp/flexh2o-timed.lock sh -c "(date -u; uptime) >> $O.uptime; farm-bench -n 3 --warmup 0 --timeout 400 --vs \"sh -c 'exec $R --log-file $O.B.jsonl >>$O.B.txt 2>&1'\" -- sh -c 'exec $R --compress-cache --log-file $O.A.jsonl >>$O.A.txt 2>&1' > $O.pairs.txt 2>&1; (date -u; uptime) >> $O.uptime"
python ../write-one-call-2026-12-07-442fc5f/pairs.py $O >> $O.pairs.txt
(date -u; uptime) >> $O.uptime
tail -3 $O.pairs.txt
