#!/usr/bin/env bash
# One device call on the H200: correctness first, then the benchmarks named as arguments, each under its
# own time budget so one slow phase cannot eat the call. Results land in $OUT (JSON + logs).
#   bash benchmarks/run_h200.sh gpu-tests gpu:300              # GPU tests, then bench_gpu.py (GPU_ARGS)
#   bash benchmarks/run_h200.sh gpu-tests prefill beam          # core engine (≈ 4 min)
#   bash benchmarks/run_h200.sh backends                        # eager/compile/aoti/+graphs, W1-W4 (≈ 9.5 min)
#   bash benchmarks/run_h200.sh fp8-kernels fp8-model           # selective FP8 + fidelity gate (≈ 8 min)
#   bash benchmarks/run_h200.sh fp8-demo-gate fp8-sensitivity   # the gate on the demo model, real FP8
#   bash benchmarks/run_h200.sh fp8-selective                   # compiled W1/W2: bf16, mlp, mlp:skip=0,-1
#   bash benchmarks/run_h200.sh serving                         # W5 HTTP vs HF server (carry .whl; ≈ 6 min)
#   bash benchmarks/run_h200.sh ray                             # Ray Serve 1 replica vs plain (carry .whl .whl-ray)
# Wheels for the last two: `bash benchmarks/fetch_device_wheels.sh --with-ray` here first.
set -u
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 BOUNDGEN_CACHE=${BOUNDGEN_CACHE:-/tmp/boundgen-cache} RAY_USAGE_STATS_ENABLED=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=${ROOT:-/tmp/boundgen-models}
. benchmarks/device_wheels.sh
[ -n "${SKIP_WHEELS:-}" ] || install_device_wheels
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
# A phase's budget can be overridden as NAME:SECONDS (e.g. fp8-model:200) to fit a 10-minute call.
phase() { local name=$1 budget=${B:-$2}; shift 2; echo "=== $name (budget ${budget}s)"; timeout "$budget" "$@" 2>&1 | tee "$OUT/$name.log" | tail -45; }
for spec in "$@"; do
  p=${spec%%:*}; B=; [ "$p" != "$spec" ] && B=${spec#*:}
  case $p in
    gpu-tests) phase gpu-tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ ${GPU_TEST_ARGS:-} ;;
    gpu) phase gpu 560 python3 benchmarks/bench_gpu.py --root $ROOT --out "$OUT/gpu.json" --budget-s $(( ${B:-560} - 20 )) ${GPU_ARGS:-} ;;
    prefill) phase prefill 290 python3 benchmarks/bench_prefill.py --root $ROOT --out "$OUT/prefill.json" ;;
    beam) phase beam 140 python3 benchmarks/bench_beam.py --root $ROOT --out "$OUT/beam.json" ;;
    profile) phase profile 90 python3 benchmarks/profile_host.py --root $ROOT --out "$OUT/profile.txt" ;;
    backends) phase backends 575 python3 benchmarks/bench_backends.py --root $ROOT --out "$OUT/backends.json" --budget-s $(( ${B:-575} - 15 )) ;;
    fp8-kernels) phase fp8-kernels 240 python3 benchmarks/bench_fp8.py --sections env,gemm,quant,mlp --out "$OUT/fp8_kernels.json" ;;
    fp8-model) phase fp8-model 330 python3 benchmarks/bench_fp8.py --sections env,model,gate --out "$OUT/fp8_model.json" ;;
    fp8-selective) phase fp8-selective 560 python3 benchmarks/bench_fp8.py --sections env,compiled --policies none mlp mlp:skip=0,-1 --out "$OUT/fp8_selective.json" ;;
    fp8-demo-gate) phase fp8-demo-gate 240 python3 -m boundgen.cli quant-check --model src/boundgen/demo/assets --fp8 all --scale small --noise-floor --no-record --json "$OUT/fp8_demo_gate.json" ;;
    fp8-sensitivity) phase fp8-sensitivity 300 python3 benchmarks/fp8_sensitivity.py --device cuda --scale small --out "$OUT/fp8_sensitivity.json" ;;
    serving) phase serving 540 python3 benchmarks/bench_serving.py --device cuda --qps-steps 50 100 200 400 800 1600 --duration 15 --out-dir "$OUT" ;;
    runtime) phase runtime 200 python3 benchmarks/bench_runtime.py --preset qwen2.5-0.5b --device cuda --dtype bfloat16 --out "$OUT/runtime.json" ;;
    ray) phase ray 290 python3 benchmarks/bench_ray.py --out-dir "$OUT" ${RAY_ARGS:-} ;;
    *) echo "unknown phase $p" ;;
  esac
done
