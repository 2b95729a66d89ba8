#!/usr/bin/env bash
# One call on nvidia-h200-x2: two independent phase lists of run_h200.sh side by side, one per GPU, so a
# 10-minute call measures twice as much. Each list has its own model and artifact caches (no two writers
# of one checkpoint) and its own results folder; both are packed into $OUT/results.tgz at the end (the
# device tool returns at most 8 files).
#   bash benchmarks/run_h200_pair.sh "gpu-tests backends:540" "fp8-kernels:200 fp8-model:300"
set -u
OUT=${OUT:-/tmp/out}; WORK=/tmp/pair; rm -rf "$WORK"; mkdir -p "$WORK/gpu0" "$WORK/gpu1" "$OUT"
. benchmarks/device_wheels.sh
install_device_wheels  # once, before both lists start
for g in 0 1; do
  l=$1; [ "$g" = 1 ] && l=$2
  CUDA_VISIBLE_DEVICES=$g OUT="$WORK/gpu$g" ROOT=/tmp/models$g BOUNDGEN_CACHE=/tmp/cache$g \
    bash benchmarks/run_h200.sh $l > "$WORK/gpu$g.log" 2>&1 &
done
wait
tar czf "$OUT/results.tgz" -C "$WORK" .
for g in 0 1; do echo "##### gpu$g"; grep -v "^  \[" "$WORK/gpu$g.log" | tail -c 5500; done
