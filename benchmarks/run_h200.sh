#!/usr/bin/env bash
# One device call on the H200: correctness first, then the benchmarks named as arguments.
#   bash benchmarks/run_h200.sh gpu-tests prefill beam
# Results land in $OUT (JSON + logs). Each phase has its own time budget so one slow phase cannot eat the call.
set -u
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 BOUNDGEN_CACHE=/tmp/boundgen-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=/tmp/boundgen-models
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
phase() { local name=$1 budget=$2; shift 2; echo "=== $name"; timeout "$budget" "$@" 2>&1 | tee "$OUT/$name.log" | tail -40; }
for p in "$@"; do
  case $p in
    gpu-tests) phase gpu-tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py tests/test_attention.py ;;
    prefill) phase prefill 290 python3 benchmarks/bench_prefill.py --root $ROOT --out "$OUT/prefill.json" ;;
    beam) phase beam 140 python3 benchmarks/bench_beam.py --root $ROOT --out "$OUT/beam.json" ;;
    *) echo "unknown phase $p" ;;
  esac
done
