#!/usr/bin/env bash
# One GPU session's work in one command: GPU tests, kernel micro-benchmark, decode sweeps.
# Usage: bash scripts/gpu_check.sh [tests] [oasis-tests] [kernels] [kernels-fp8] [scores] [gather]
#        [profile] [profile-oasis] [bench] [bench-quick] [oasis-quick] [oasis-real] [oasis-emulated]
#        [compare] [fp8-bench] [moe-bench] [guardrail-cost] [metrics] [tp] [pd-smoke] [pd-partial]
#        [pd-bench] [profile-host] [open-block] [dense-dtypes] [sparse-kernel] [kernel-compare] [store]
#        (default: tests kernels bench)
# HOST_GIB (default 96) sizes the oasis host store for oasis-real; the machine needs that much free RAM.
# REAL_LENS / REAL_MODES narrow oasis-real (e.g. REAL_LENS=32768 REAL_MODES="sync ngram"); REAL_MAX_SEQS
# (default 64) bounds its oasis batch (a larger host store holds more requests). EMU_PREFETCH (default
# "async off") narrows oasis-emulated. EMU_HOST_GIB (default 700) sizes the emulated host of every
# EMULATED stage: its block ids' summaries live in HBM (330 holds 128 x 32K in FP8 and fits an H100).
# Needs the fixture models in .fixtures/pycode-19m (or OASISKV_FIXTURES). Writes logs to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/oasiskv-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export OASISKV_FIXTURES=${OASISKV_FIXTURES:-$PWD/.fixtures/pycode-19m}
stages=${*:-tests kernels bench}
summary=()
HOST_GIB=${HOST_GIB:-96}
KV_DTYPE=${KV_DTYPE:-auto}  # --kv-cache-dtype of oasis-real, oasis-emulated and profile-oasis
SUMMARY_DTYPE=${SUMMARY_DTYPE:-auto}  # --summary-dtype of oasis-emulated and profile-oasis
REAL_LENS=${REAL_LENS:-16384,32768}  # oasis-real: context lengths, and REAL_MODES (default: dense sync ngram)
bench() {  # name, then bench flags: BENCH_MODEL (Qwen3-8B shape), random weights; table to the log
  # (-P: the package comes from PYTHONPATH, which compare points at .before/, not from the working
  # directory that `python -m` would put first)
  local name=$1; shift
  python3 -P -m oasiskv.cli --log-level WARNING bench "${BENCH_MODEL:-qwen3-8b}" --max-num-seqs 256 "$@" 2>&1 \
    | tee "$OUT/$name.log" | grep -v '^{' | tail -8
  summary+=("$name: $(grep -E '^(oasis|oasiskv)' "$OUT/$name.log" | awk '{print $1, $2, $3, $5, $6, $7, $11, $12}' | tr '\n' '|')")
}

tree_dir() {  # the package tree a run named before-* / before uses: .before/, else this one
  if [ "${1%%-*}" = before ]; then echo "$PWD/.before"; else echo "$PWD"; fi
}

need() {  # install missing packages from wheels staged in .whl (the machine has no index), e.g.
  # `pip download -d .whl --no-deps --only-binary=:all: --python-version 3.12 --platform
  # manylinux2014_x86_64 --platform manylinux_2_28_x86_64 fastapi starlette uvicorn pydantic
  # pydantic-core annotated-types typing-inspection nixl-cu13==1.5.1`, then `python
  # scripts/slim_wheel.py .whl/nixl_cu13-*.whl nixl_ep_cu13 nixl_cu13-1.5.1.data/headers
  # nixl_cu13.scripts --out .whl --only-needed-by libnixl.so _bindings _utils libplugin_UCX.so
  # libplugin_POSIX.so ucx/` (56 -> 18 MiB: the tree, .whl and the packed fixture target then fit
  # the 64 MiB a run takes)
  python3 -m pip install -q --no-index --find-links .whl "$@" 2>&1 | tail -2
}

# Fixture parts carried packed are unpacked where OASISKV_FIXTURES points, each archive once:
# `tar -cJf .fixtures/pycode-19m-target.tar.xz -C <fixtures> pycode-19m/target pycode-19m/eval_dev.json`
# (27 MB against 44 unpacked) and, for the drafter tests, `tar -cJf .fixtures/pycode-19m-drafters.tar.xz
# -C <fixtures> pycode-19m/draft pycode-19m/eagle3` (11 MB).
for packed in .fixtures/*.tar.xz; do
  [ -f "$packed" ] || continue
  part=$(tar -tJf "$packed" | head -1); part=${part%/}
  if [ ! -e "$(dirname "$OASISKV_FIXTURES")/$part" ]; then
    mkdir -p "$(dirname "$OASISKV_FIXTURES")" && tar -xJf "$packed" -C "$(dirname "$OASISKV_FIXTURES")"
  fi
done

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

for stage in $stages; do
  case $stage in
    tests)
      python3 -m pytest -m gpu -q -p no:cacheprovider --ignore=tests/server tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
      summary+=("gpu tests: $(tail -1 "$OUT/gpu_tests.log")") ;;
    oasis-tests)  # tiered KV and prefetch tests, all of them on the GPU (tiny models, fixture target)
      python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/engine/test_oasis.py \
        tests/engine/test_prefetch.py 2>&1 | tee "$OUT/oasis_tests.log" | tail -30
      summary+=("oasis tests: $(tail -1 "$OUT/oasis_tests.log")") ;;
    oasis-quick)
      for draft in none ngram; do
        bench "quick-$draft" --context-lens 16384 --concurrency 8 --output-lens 16 --kv-mode oasis \
          --host-kv-gib 24 --draft "$draft"
      done ;;
    oasis-real)  # (a): the host store this machine's RAM holds; dense for reference
      for mode in ${REAL_MODES:-dense sync ngram}; do
        if [ "$mode" = dense ]; then
          bench real-dense --context-lens "$REAL_LENS" --concurrency max --output-lens 32 --max-num-seqs 64
        else
          draft=$mode; [ "$mode" = sync ] && draft=none
          bench "real-$mode" --context-lens "$REAL_LENS" --concurrency max --output-lens 32 \
            --max-num-seqs "${REAL_MAX_SEQS:-64}" --kv-mode oasis --host-kv-gib "$HOST_GIB" --draft "$draft" \
            --kv-cache-dtype "$KV_DTYPE"
        fi
      done ;;
    oasis-emulated)  # (b): a 700 GiB host emulated over 16 GiB (labelled); summaries stay real: HBM bounds it
      # (OPEN_BLOCK: --kv-open-block, default model)
      for prefetch in ${EMU_PREFETCH:-async off}; do
        bench "emulated-$prefetch" --context-lens 32768 --concurrency "${EMU_CONC:-64}" --output-lens 32 \
          --max-num-seqs 128 --kv-mode oasis --host-kv-gib 16 --emulated-host-gib "${EMU_HOST_GIB:-700}" --draft ngram \
          --prefetch "$prefetch" --kv-cache-dtype "$KV_DTYPE" --summary-dtype "$SUMMARY_DTYPE" \
          --kv-open-block "${OPEN_BLOCK:-model}"
      done ;;
    compare)  # before/after a change: dense 32K x max (KV_DTYPE) and the emulated-host point (EMU_CONC x
      # 32K, ngram, async, KV_DTYPE, SUMMARY_DTYPE), the tree in .before/ (e.g. `git archive BASE oasiskv | tar -x -C
      # .before`) and this one, interleaved so both see the same machine; COMPARE_RUNS narrows it.
      # The emulated point at EMU_CONC=128 takes about 8 minutes on an H200 (mostly the prefill of
      # 4.2M prompt tokens): one tree per device call, on the same warm machine
      for run in ${COMPARE_RUNS:-before-dense after-dense before-emulated after-emulated}; do
        export PYTHONPATH=$(tree_dir "$run")
        if [ "${run#*-}" = dense ]; then
          bench "$run" --context-lens 32768 --concurrency max --output-lens 32 --max-num-seqs 64 \
            --kv-cache-dtype "$KV_DTYPE"
        else
          bench "$run" --context-lens 32768 --concurrency "${EMU_CONC:-64}" --output-lens 32 --max-num-seqs 128 \
            --kv-mode oasis --host-kv-gib 16 --emulated-host-gib "${EMU_HOST_GIB:-700}" --draft ngram --prefetch async \
            --kv-cache-dtype "$KV_DTYPE" --summary-dtype "$SUMMARY_DTYPE"
        fi
      done
      export PYTHONPATH=$PWD ;;
    dense-dtypes)  # dense 32K x max with each KV dtype in DENSE_DTYPES (default: auto fp8); DENSE_FLAGS
      # adds bench flags (e.g. --no-async-scheduling)
      for dt in ${DENSE_DTYPES:-auto fp8}; do
        bench "dense-$dt" --context-lens 32768 --concurrency max --output-lens 32 --max-num-seqs 128 \
          --kv-cache-dtype "$dt" ${DENSE_FLAGS:-}
      done ;;
    open-block)  # dense FP8 32K x max, open blocks in bf16 (OPEN_MODES: model kv) in turn
      for ob in ${OPEN_MODES:-kv model}; do
        bench "dense-fp8-open-$ob" --context-lens 32768 --concurrency max --output-lens 32 \
          --max-num-seqs 128 --kv-cache-dtype fp8 --kv-open-block "$ob"
      done ;;
    fp8-bench)  # bf16 vs FP8 KV: dense 32K x max, and the emulated-host point (64 x 32K, ngram, async)
      for dt in auto fp8; do
        bench "dense-$dt" --context-lens 32768 --concurrency max --output-lens 32 --max-num-seqs 128 \
          --kv-cache-dtype "$dt"
      done
      for dt in auto fp8; do
        bench "emulated-$dt" --context-lens 32768 --concurrency "${EMU_CONC:-64}" --output-lens 32 \
          --max-num-seqs 128 --kv-mode oasis --host-kv-gib 16 --emulated-host-gib "${EMU_HOST_GIB:-700}" --draft ngram \
          --kv-cache-dtype "$dt"
      done ;;
    moe-bench)  # Qwen3-30B-A3B shape: dense, then oasis (EMULATED host, ngram, async), 16K and 32K, max
      # batch; MOE_MODES / MOE_LENS narrow it, MOE_MAX_SEQS (default 128) bounds the oasis batch
      for mode in ${MOE_MODES:-dense oasis}; do
        flags=(--context-lens "${MOE_LENS:-16384,32768}" --concurrency max --output-lens 32)
        [ "$mode" = oasis ] && flags+=(--kv-mode oasis --host-kv-gib 16 --emulated-host-gib "${EMU_HOST_GIB:-700}" --draft ngram
                                       --max-num-seqs "${MOE_MAX_SEQS:-128}")
        BENCH_MODEL=qwen3-30b-a3b bench "moe-$mode" "${flags[@]}"
      done ;;
    guardrail-cost)  # the guardrail's price: EMULATED host, 64 x 32K, ngram, async, R = 0 then 0.01
      for rate in ${GUARD_RATES:-0 0.01}; do
        bench "guardrail-$rate" --context-lens 32768 --concurrency 64 --output-lens 32 \
          --max-num-seqs 128 --kv-mode oasis --host-kv-gib 16 --emulated-host-gib "${EMU_HOST_GIB:-700}" --draft ngram \
          --guardrail-rate "$rate"
      done ;;
    metrics)  # a real tiered server's /metrics under load (real host store, guardrail on)
      need fastapi uvicorn pydantic
      python3 scripts/metrics_check.py qwen3-8b --context 32768 --requests "${METRICS_REQUESTS:-8}" \
        --max-tokens 32 -- --kv-mode oasis --host-kv-gib 48 --draft ngram --guardrail-rate 0.1 \
        2>&1 | tee "$OUT/metrics.log" | tail -40
      summary+=("metrics: $(tail -1 "$OUT/metrics.log")") ;;
    tp)  # 2 GPUs: TP = 2 vs 1 greedy tokens (NCCL, graphs per rank), then Qwen3-8B and Qwen3-30B-A3B
      # at 32K, max batch, dense and tiered (EMULATED host), one GPU vs two
      python3 -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_tensor_parallel.py 2>&1 \
        | tee "$OUT/tp_tests.log" | tail -5
      summary+=("tp tests: $(tail -1 "$OUT/tp_tests.log")")
      for model in ${TP_MODELS:-qwen3-8b qwen3-30b-a3b}; do
        for size in 1 2; do
          BENCH_MODEL=$model bench "tp$size-$model-dense" --context-lens 32768 --concurrency max \
            --output-lens 32 --tensor-parallel-size "$size"
          BENCH_MODEL=$model bench "tp$size-$model-oasis" --context-lens 32768 --concurrency max \
            --output-lens 32 --max-num-seqs 128 --tensor-parallel-size "$size" --kv-mode oasis \
            --host-kv-gib 16 --emulated-host-gib "${EMU_HOST_GIB:-700}" --draft ngram
        done
      done ;;
    pd-smoke)  # 1 GPU: the disaggregated path on CUDA, both workers sharing the GPU (0.4 of its memory
      # each), PD_REQUESTS (default 8) x 8K prompts; carry .whl (NIXL and the server packages) without
      # the fixtures. PD_SETUPS (default single,pd,pd-cache:0.2: a decode-host cache of 4 GiB, the 8
      # prompts' KV being 9.4 GB); PD_TREES="before after" runs the tree in .before/ first (compare)
      need fastapi uvicorn pydantic httpx nixl-cu13
      for tree in ${PD_TREES:-after}; do
        PYTHONPATH=$(tree_dir "$tree") python3 scripts/pd_bench.py "${BENCH_MODEL:-qwen3-8b}" --context 8192 \
          --requests "${PD_REQUESTS:-8}" --max-tokens 32 --prefill-gpu 0 --decode-gpu 0 \
          --prefill-flags "--gpu-memory-utilization 0.4" --setups "${PD_SETUPS:-single,pd,pd-cache:0.2}" \
          --decode-flags "--host-kv-gib 4" -- --kv-mode oasis --host-kv-gib 24 --draft ngram \
          --gpu-memory-utilization 0.8 2>&1 | tee "$OUT/pd_smoke_$tree.log" | grep -v '^{' | tail -6
        summary+=("pd-smoke $tree: $(tail -1 "$OUT/pd_smoke_$tree.log" | cut -c1-400)")
      done ;;
    pd-partial)  # 1 GPU: full against partial admission on the fixture target (trained), both workers
      # sharing the GPU, 16 x 8K windows of held-out text, decode-host cache f_host 0.2; carry .whl
      # and .fixtures (the packed target, see above: both fit one call);
      # PD_TREES="before after" runs the tree in .before/ first (compare)
      need fastapi uvicorn pydantic httpx nixl-cu13
      for tree in ${PD_TREES:-after}; do
        PYTHONPATH=$(tree_dir "$tree") python3 scripts/pd_bench.py "$OASISKV_FIXTURES/target" \
          --text "$OASISKV_FIXTURES/eval_dev.json" --context 8192 --requests 16 --max-tokens 64 \
          --prefill-gpu 0 --decode-gpu 0 --prefill-flags "--gpu-memory-utilization 0.3" \
          --setups "${PD_SETUPS:-single,pd-cache:0.2,pd-partial:0.2}" --decode-flags "--host-kv-gib 0.5" \
          -- --kv-mode oasis --host-kv-gib 2 --draft ngram --topk-blocks 32 --fetch-ratio 0.05 \
          --gpu-memory-utilization 0.7 2>&1 | tee "$OUT/pd_partial_$tree.log" | grep -v '^{' | tail -5
        summary+=("pd-partial $tree: see table above")
      done ;;
    pd-bench)  # 2 GPUs: one node vs a prefill worker (GPU 1) + decode worker (GPU 0), prompt KV over
      # NIXL; PD_REQUESTS (default 32) concurrent 32K prompts, 64 tokens each; PD_SETUPS (default
      # single,pd; add pd-memory for a memory worker on GPU 1 too, with PD_SHARES="--gpu-memory-
      # utilization 0.45" for it and the prefill worker, and host RAM for three HOST_GIB stores)
      need fastapi uvicorn pydantic httpx nixl-cu13
      python3 scripts/pd_bench.py "${BENCH_MODEL:-qwen3-8b}" --context 32768 --requests "${PD_REQUESTS:-32}" \
        --max-tokens 64 --prefill-gpu 1 --decode-gpu 0 --setups "${PD_SETUPS:-single,pd}" \
        --prefill-flags "${PD_SHARES:-}" --memory-flags "${PD_SHARES:-}" -- --kv-mode oasis --host-kv-gib "$HOST_GIB" \
        --draft ngram --kv-cache-dtype "$KV_DTYPE" 2>&1 | tee "$OUT/pd_bench.log" | grep -v '^{' | tail -8
      summary+=("pd-bench: see table above") ;;
    kernels)
      python3 -m oasiskv.bench.kernels 2>&1 | tee "$OUT/kernels.log" | tail -30
      summary+=("kernels: $(tail -1 "$OUT/kernels.log" | cut -c1-300)") ;;
    kernels-fp8)  # paged decode, bf16 vs 8-bit caches (KERNEL_DTYPES: auto fp8 int8), at the dense
      # 32K batches of each (24 / 46; KERNEL_BATCHES);
      # FP8 also sweeps the launch configs (LAUNCH_SWEEP=1); KERNEL_FLAGS adds flags (e.g.
      # "--block-size 32 --open-block --sweep-splits")
      for dt in ${KERNEL_DTYPES:-auto fp8}; do
        sweep=""; [ "$dt" = fp8 ] && [ -n "${LAUNCH_SWEEP:-}" ] && sweep=--sweep-launch
        python3 -m oasiskv.bench.kernels --kv-cache-dtype "$dt" --batches "${KERNEL_BATCHES:-46,24}" \
          --contexts 32768 $sweep ${KERNEL_FLAGS:-} 2>&1 | tee "$OUT/kernels-$dt.log" | grep -v '^{'
      done
      summary+=("kernels-fp8: see tables above") ;;
    kernel-compare)  # paged decode (KERNEL_DTYPES, default fp8 int8; 46 and 24 x 32K) and sparse decode
      # (the 128 x 32K tiered point, KV_DTYPE): the tree in .before/ and this one, interleaved
      # (KC_RUNS, default twice); LAUNCH_SWEEP=1 sweeps the paged launch configs in the last run
      runs=(${KC_RUNS:-before after before after})
      for i in "${!runs[@]}"; do
        run=${runs[$i]}
        for dt in ${KERNEL_DTYPES:-fp8 int8}; do
          sweep=""; [ "$i" = $((${#runs[@]} - 1)) ] && [ -n "${LAUNCH_SWEEP:-}" ] && sweep=--sweep-launch
          PYTHONPATH=$(tree_dir "$run") python3 -P -m oasiskv.bench.kernels --kv-cache-dtype "$dt" \
            --batches 46,24 --contexts 32768 $sweep 2>&1 | tee "$OUT/kc-$i-$run-$dt.log" | grep -v '^{' \
            | sed "s/^/$run $dt: /"
        done
        PYTHONPATH=$(tree_dir "$run") python3 -P -m oasiskv.bench.kernels --sparse --kv-cache-dtype "$KV_DTYPE" \
          2>&1 | tee "$OUT/kc-$i-$run-sparse.log" | grep -v '^{' | sed "s/^/$run sparse: /"
      done
      export PYTHONPATH=$PWD
      summary+=("kernel-compare: see tables above") ;;
    store)  # the KV store kernel (store_kv) at 46 / 128 / 8,192 tokens, each storage dtype: the tree
      # in .before/ and this one, interleaved (KC_RUNS, default twice)
      for run in ${KC_RUNS:-before after before after}; do
        PYTHONPATH=$(tree_dir "$run") python3 -P -m oasiskv.bench.kernels --store 2>&1 \
          | tee -a "$OUT/store-$run.log" | grep -v '^{' | sed "s/^/$run: /"
      done
      export PYTHONPATH=$PWD
      summary+=("store: see tables above") ;;
    sparse-kernel)  # sparse decode at the 128 x 32K tiered point, its launch configs (KV_DTYPE)
      python3 -m oasiskv.bench.kernels --sparse --kv-cache-dtype "$KV_DTYPE" 2>&1 \
        | tee "$OUT/sparse-kernel.log" | grep -v '^{'
      summary+=("sparse-kernel: see table above") ;;
    scores)  # the summary scan's launch configs, each summary dtype in SUMMARY_DTYPES (default both)
      for sd in ${SUMMARY_DTYPES:-auto fp8}; do
        python3 -m oasiskv.bench.kernels --scores --summary-dtype "$sd" 2>&1 \
          | tee "$OUT/scores-$sd.log" | grep -v '^{'
      done
      summary+=("scores: see tables above") ;;
    bench)
      python3 -m oasiskv.cli --log-level WARNING bench qwen3-8b --context-lens 16384,32768 \
        --concurrency 1,8,16,max --output-lens 64 --engine oasiskv,hf --hf-max-batch 8 \
        --max-num-seqs 64 --plot "$OUT/dense_sweep.png" 2>&1 | tee "$OUT/bench_dense.log" | grep -v '^{' | tail -30
      summary+=("bench: see table above") ;;
    gather)  # UVA gather bandwidth and its overlap with model kernels on another stream
      python3 -m oasiskv.bench.uva_gather 2>&1 | tee "$OUT/uva_gather.log" | grep -v '^{'
      summary+=("gather: see table above") ;;
    profile)  # dense decode, PROFILE_CONC (default 32) x PROFILE_LEN (default 8K), KV_DTYPE: per-stream
      # kernel time; PROFILE_FLAGS adds flags (e.g. --compare-sync: then async scheduling off)
      python3 scripts/profile_decode.py qwen3-8b --context-lens "${PROFILE_LEN:-8192}" \
        --concurrency "${PROFILE_CONC:-32}" --max-num-seqs "${PROFILE_CONC:-32}" --kv-cache-dtype "$KV_DTYPE" \
        ${PROFILE_FLAGS:-} 2>&1 \
        | tee "$OUT/profile_dense.log" | grep -v '^{'
      summary+=("profile: $(grep -h 'host wall' "$OUT"/profile_dense.log | tr '\n' ' ')") ;;
    profile-oasis)  # the oasis-emulated point, prefetch async then off: per-stream kernel time
      python3 scripts/profile_decode.py qwen3-8b --context-lens 32768 --concurrency "${EMU_CONC:-64}" \
        --max-num-seqs 128 --kv-mode oasis --host-kv-gib 16 --emulated-host-gib "${EMU_HOST_GIB:-700}" --draft ngram \
        --kv-cache-dtype "$KV_DTYPE" --summary-dtype "$SUMMARY_DTYPE" --compare-prefetch-off --python-top "${PYTHON_TOP:-0}" 2>&1 | tee "$OUT/profile_oasis.log" \
        | grep -v '^{'
      summary+=("profile-oasis: $(grep -h 'host wall' "$OUT"/profile_oasis.log | tr '\n' ' ')") ;;
    profile-host)  # the host's work between replays with prefetch off (what the GPU waits through):
      # EMU_CONC (default 128) x 32K, EMULATED host, ngram, KV_DTYPE, host stages timed; SHARED_PROMPTS=1
      # prefills one prompt (prompts share all but their last block); PROFILE_TREES="before after"
      # runs the tree in .before/ first (see compare)
      for tree in ${PROFILE_TREES:-after}; do
        PYTHONPATH=$(tree_dir "$tree") python3 -P scripts/profile_decode.py qwen3-8b --context-lens 32768 \
          --concurrency "${EMU_CONC:-128}" --max-num-seqs 128 --kv-mode oasis --host-kv-gib 16 \
          --emulated-host-gib "${EMU_HOST_GIB:-700}" --draft ngram --kv-cache-dtype "$KV_DTYPE" --prefetch off \
          --host-stages ${SHARED_PROMPTS:+--shared-prompts} 2>&1 | tee "$OUT/profile_host_$tree.log" | grep -v '^{'
        summary+=("profile-host $tree: $(grep -h -E 'host wall|next replay|idle' "$OUT/profile_host_$tree.log" | tr '\n' ' ')")
      done ;;
    bench-quick)
      python3 -m oasiskv.cli --log-level WARNING bench qwen3-8b --context-lens 4096 --concurrency 1,8 \
        --output-lens 32 --engine oasiskv --max-num-seqs 16 --max-num-batched-tokens 8192 2>&1 \
        | tee "$OUT/bench_quick.log" | grep -v '^{' | tail -12 ;;
  esac
done
echo "==== summary"
printf '%s\n' "${summary[@]}"
