#!/usr/bin/env bash
# Run one command per GPU at once on the GPU host (device tool, kind nvidia-h200-x2), each
# through tools/gpu_run.sh, each cut off after SECONDS so that results come back even when a
# stream runs long.  Stream i sees only GPU i and writes its files under $RES/s<i>; at the end
# $RES is packed into $OUT/results.tgz (the device tool returns at most 8 files) and each
# stream's log is $OUT/stream<i>.log.
#   tools/gpu_parallel.sh 540 'python3 tools/bench_ttft.py --out $RES/s0/ttft.json' 'pytest ...'
set -u
seconds=$1
shift
export RES=${RES:-/tmp/minipic-results}
mkdir -p "$RES"
tools/gpu_run.sh true   # unpack the bundle once, before the streams race to do it
i=0
for command in "$@"; do
    mkdir -p "$RES/s$i"
    CUDA_VISIBLE_DEVICES=$i timeout -k 10 "$seconds" tools/gpu_run.sh bash -c "$command" \
        >"$OUT/stream$i.log" 2>&1 &
    i=$((i + 1))
done
wait
tar czf "$OUT/results.tgz" -C "$RES" .
