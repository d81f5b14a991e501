#!/usr/bin/env bash
# One GPU session's work in one command: GPU tests, kernel micro-benchmark, dense decode sweep.
# Usage: bash scripts/gpu_check.sh [tests] [kernels] [profile] [bench] [bench-quick]
# (default: tests kernels bench)
# Needs the fixture models in .fixtures/pycode-19m (or OASISKV_FIXTURES). Writes logs to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/oasiskv-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export OASISKV_FIXTURES=${OASISKV_FIXTURES:-$PWD/.fixtures/pycode-19m}
stages=${*:-tests kernels bench}
summary=()

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

for stage in $stages; do
  case $stage in
    tests)
      python3 -m pytest -m gpu -q -p no:cacheprovider --ignore=tests/server tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
      summary+=("gpu tests: $(tail -1 "$OUT/gpu_tests.log")") ;;
    kernels)
      python3 -m oasiskv.bench.kernels 2>&1 | tee "$OUT/kernels.log" | tail -30
      summary+=("kernels: $(tail -1 "$OUT/kernels.log" | cut -c1-300)") ;;
    bench)
      python3 -m oasiskv.cli --log-level WARNING bench qwen3-8b --context-lens 16384,32768 \
        --concurrency 1,8,16,max --output-lens 64 --engine oasiskv,hf --hf-max-batch 8 \
        --max-num-seqs 64 --plot "$OUT/dense_sweep.png" 2>&1 | tee "$OUT/bench_dense.log" | grep -v '^{' | tail -30
      summary+=("bench: see table above") ;;
    profile)
      python3 scripts/profile_decode.py qwen3-8b 1 4096 2>&1 | tee "$OUT/profile_b1.log" | head -22
      python3 scripts/profile_decode.py qwen3-8b 32 8192 2>&1 | tee "$OUT/profile_b32.log" | head -22
      summary+=("profile: $(grep -h 'host wall' "$OUT"/profile_b*.log | tr '\n' ' ')") ;;
    bench-quick)
      python3 -m oasiskv.cli --log-level WARNING bench qwen3-8b --context-lens 4096 --concurrency 1,8 \
        --output-lens 32 --engine oasiskv --max-num-seqs 16 --max-num-batched-tokens 8192 2>&1 \
        | tee "$OUT/bench_quick.log" | grep -v '^{' | tail -12 ;;
  esac
done
echo "==== summary"
printf '%s\n' "${summary[@]}"
