#!/usr/bin/env bash
# One call on an NVIDIA GPU machine: Metal->CUDA bridge checks, a lily-vs-stock smoke test, kernel
# microbenchmarks and the end-to-end sweep, results under $OUT (default ./device_out).
#
#   bash bench/device_run.sh [--parts bridge,smoke,tests,kernels,e2e] [--lengths 256,1K,4K,16K]
#                            [--rounds 2] [--long-rounds 1] [--gen-tokens 32] [--model PATH]
#                            [--lily-backend auto|cuda|reference]
#                            [--engines stock,lily,lily-off:register_scan,...]  (switch ablations end to end)
#                            [--smoke-timeout 330] [--tests-timeout 240] [--tests-k EXPR]
#
# Parts: bridge (bridge feature checks), smoke (fp32-oracle agreement of lily's kernels with stock on a
# 4-layer full-width random model, all kernels and one family at a time), tests (the kernel test files
# on this GPU, LILY_TEST_KERNEL_BACKEND=cuda: DeltaNet, MoE, attention, traced decode), kernels (each kernel alone), e2e (stock vs lily sweep).
# A fresh machine spends minutes in first-time NVRTC compiles: give smoke at least 5 minutes.
#
# With MLX's CUDA backend staged and on PYTHONPATH (see docs/benchmarks.md), on the GPU machine:
#   bash bench/device_run.sh --parts bridge,smoke,e2e
# If the smoke test finds lily's CUDA kernels disagree with stock, the sweep runs lily on the
# reference backend (and says so in results.json): numbers never come from a wrong computation.
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS=bridge,smoke,kernels,e2e
LENGTHS=256,1K,4K,16K
ROUNDS=2
LONG_ROUNDS=1
GEN_TOKENS=32
ENGINES=stock,lily
MODEL=()
LILY_BACKEND_CHOICE=auto
SMOKE_TIMEOUT=330
TESTS_TIMEOUT=240
TESTS_K="not embedded and not forward_with_sim"
while [ $# -gt 0 ]; do
  case "$1" in
    --parts) PARTS=$2; shift 2;;
    --lengths) LENGTHS=$2; shift 2;;
    --rounds) ROUNDS=$2; shift 2;;
    --long-rounds) LONG_ROUNDS=$2; shift 2;;
    --gen-tokens) GEN_TOKENS=$2; shift 2;;
    --engines) ENGINES=$2; shift 2;;
    --model) MODEL=(--model "$2"); shift 2;;
    --lily-backend) LILY_BACKEND_CHOICE=$2; shift 2;;
    --smoke-timeout) SMOKE_TIMEOUT=$2; shift 2;;
    --tests-timeout) TESTS_TIMEOUT=$2; shift 2;;
    --tests-k) TESTS_K=$2; shift 2;;
    *) echo "unknown argument $1"; exit 2;;
  esac
done
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOG="$OUT/log.txt"
has() { [[ ",$PARTS," == *",$1,"* ]]; }
say() { echo "[device_run $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
# Compiled kernels kept on disk: later processes (and later calls on the same machine) skip NVRTC.
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$HOME/.cache/lily-mlx-ptx}

say "parts=$PARTS lengths=$LENGTHS rounds=$ROUNDS long_rounds=$LONG_ROUNDS gen_tokens=$GEN_TOKENS"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 || true; } | tee -a "$LOG"
$PY -c 'import mlx.core as mx, mlx_lm; print("mlx", mx.__version__, "mlx-lm", mlx_lm.__version__, mx.default_device(), "cuda", mx.cuda.is_available())' 2>&1 | tee -a "$LOG"

if has bridge; then
  say "bridge checks (features + MLX-LM GDN kernels vs gated_delta_ops)"
  LILY_BACKEND=cuda $PY -m bench.run --mode bridge --out "$OUT/bridge" 2>&1 | tee -a "$LOG"
fi

if [ "$LILY_BACKEND_CHOICE" = auto ]; then
  LILY_BACKEND_CHOICE=cuda
  if has smoke; then
    say "smoke: lily (cuda kernels) vs stock on a 4-layer full-width random model"
    if ! timeout "$SMOKE_TIMEOUT" $PY -m bench.smoke --size full --num-layers 4 --prompt 300,40 \
        --decode-steps 4 --per-family 2>&1 | tee -a "$LOG" "$OUT/smoke.txt"; then
      say "smoke MISMATCH: lily runs on the reference backend for the benchmarks"
      LILY_BACKEND_CHOICE=reference
    fi
  fi
fi
export LILY_BACKEND=$LILY_BACKEND_CHOICE
say "lily backend for benchmarks: $LILY_BACKEND"

if has tests; then
  say "kernel tests on this GPU (-k '$TESTS_K', limit ${TESTS_TIMEOUT}s)"
  CI=true LILY_TEST_KERNEL_BACKEND=cuda timeout "$TESTS_TIMEOUT" $PY -m pytest -v -p no:cacheprovider -o addopts= \
    tests/kernels/test_deltanet_kernels.py tests/kernels/test_moe_kernels.py tests/kernels/test_attention_kernels.py \
    tests/kernels/test_attention_prefill.py \
    tests/kernels/test_compiled_decode.py -k "$TESTS_K" -rA --durations=15 \
    2>&1 | tee "$OUT/pytest_output.txt" | tee -a "$LOG" >/dev/null
  say "kernel tests: $(tail -n 1 "$OUT/pytest_output.txt")"
fi

MODES=()
has kernels && [ "$LILY_BACKEND" = cuda ] && MODES+=(kernels)
has e2e && MODES+=(e2e)
if [ ${#MODES[@]} -gt 0 ]; then
  mode=$(IFS=,; echo "${MODES[*]}")
  say "bench.run --mode $mode"
  $PY -m bench.run --mode "$mode" "${MODEL[@]}" --lengths "$LENGTHS" --rounds "$ROUNDS" \
      --long-rounds "$LONG_ROUNDS" --gen-tokens "$GEN_TOKENS" --engines "$ENGINES" --out "$OUT/bench" 2>&1 | tee -a "$LOG"
fi
say "done"
