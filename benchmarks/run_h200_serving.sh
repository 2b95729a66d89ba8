#!/usr/bin/env bash
# One call on nvidia-h200-x2 for the serving issues: GPU tests (GPU 1) while the W5 buckets compile
# (GPU 0, `boundgen compile`), then side by side: W5 boundgen vs the HF server (GPU 0) and Ray Serve
# 1 replica vs plain `boundgen serve` (GPU 1), both on AOTInductor + CUDA graphs. Results are packed into
# $OUT/results.tgz. Needs `.whl` and `.whl-ray` carried (benchmarks/fetch_device_wheels.sh --with-ray).
#   bash benchmarks/run_h200_serving.sh            # ≈ 8 min
#   STAGES=ray2 bash benchmarks/run_h200_serving.sh   # issue 10: Ray 1 vs 2 replicas (one GPU each)
set -u
OUT=${OUT:-/tmp/out}; W=/tmp/serving; rm -rf "$W"; mkdir -p "$W" "$OUT"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1 BOUNDGEN_CACHE=/tmp/bg-cache RAY_USAGE_STATS_ENABLED=0
. benchmarks/device_wheels.sh
install_device_wheels
M=/tmp/bg-cache/qwen2.5-0.5b-bf16
python3 -c "from boundgen.checkpoints import make_model; make_model('qwen2.5-0.5b', '$M', dtype='bfloat16', overwrite=True, progress=False)"
# W2-shaped requests merged 1..8 at a time (the batch budget caps merges at 8): common.w5_buckets
SCORE_BUCKETS=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import common; print(','.join(common.w5_buckets(warmup=False)))")
BUCKETS=${BUCKETS:-$SCORE_BUCKETS,t256,t1024}; [ "${STAGES:-main}" = main ] || BUCKETS=$SCORE_BUCKETS
SERVE="--backend aoti+graphs --batch-token-budget 15000"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
if [ "${STAGES:-main}" = main ]; then
  (CUDA_VISIBLE_DEVICES=1 timeout 240 python3 -m pytest -v -x -p no:cacheprovider tests/test_gpu.py \
     tests/test_attention.py tests/test_compile_gpu.py tests/test_trie.py tests/test_fp8.py > "$W/gpu-tests.log" 2>&1; \
   echo "gpu-tests rc=$?" >> "$W/gpu-tests.log") &
fi
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m boundgen.cli compile --model "$M" --device cuda --dtype bfloat16 \
  --buckets "$BUCKETS" --jobs 6 --no-verify --json "$W/compile.json" > "$W/compile.log" 2>&1; el "compile rc=$?"
wait; el "gpu tests done"; tail -3 "$W/gpu-tests.log" 2>/dev/null
if [ "${STAGES:-main}" = main ]; then
  (CUDA_VISIBLE_DEVICES=0 timeout 330 python3 benchmarks/bench_serving.py --model "$M" --device cuda \
     --serve-args "$SERVE" --qps-steps 25 50 100 150 200 300 400 600 --duration 10 --out-dir "$W/serving" \
     > "$W/serving.log" 2>&1; el "serving rc=$?") &
  (CUDA_VISIBLE_DEVICES=1 LD_PRELOAD=/lib/x86_64-linux-gnu/libstdc++.so.6 timeout 330 python3 benchmarks/bench_ray.py \
     --model "$M" --serve-args "$SERVE" --score-qps 20 40 80 160 240 320 480 --out-dir "$W/ray" \
     > "$W/ray.log" 2>&1; el "ray rc=$?") &
  wait
else  # 1 vs 2 replicas, score workload (W5), in the same lease
  LD_PRELOAD=/lib/x86_64-linux-gnu/libstdc++.so.6 timeout ${RAY2_BUDGET:-400} python3 benchmarks/bench_ray.py \
    --model "$M" --serve-args "$SERVE" --servers ray-1 ray-2 --workloads score --client-processes 4 \
    --score-qps ${RAY2_QPS:-40 80 160 240 320 480 640 800} --serial-score 50 --out-dir "$W/ray2" > "$W/ray2.log" 2>&1
  el "ray2 rc=$?"
fi
tar czf "$OUT/results.tgz" -C "$W" --exclude='*.npy' .
for f in "$W"/serving/w5_score.md "$W"/ray/ray_vs_plain.md "$W"/ray2/ray_vs_plain.md; do [ -f "$f" ] && { echo "## $f"; cat "$f"; }; done
for f in serving ray ray2; do [ -f "$W/$f.log" ] && { echo "## $f.log"; grep -v "^  \[" "$W/$f.log" | tail -15; }; done
