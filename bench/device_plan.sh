#!/usr/bin/env bash
# One device call of the full sweep and the ablation table (docs/benchmarks.md, "Device plan"): runs what
# is left of both, in that order, and starts nothing that would end after BUDGET seconds; repeat the same
# command in the next call until it prints "plan: complete".
#
#   bash bench/device_plan.sh [BUDGET_S]     # default 480 s: a call has 600 s, less the MLX install before it
#   bash bench/device_plan.sh --plan         # what is left, with estimated seconds per call (runs nothing)
#
# State: $PLAN_STATE (default /root/lily_plan, kept on the machine between calls while it stays warm). On
# a fresh machine it starts from out/plan in the working tree (the previous call's $OUT/plan, copied back
# there by whoever runs the calls). Results go to $OUT/plan/{sweep,ablations} (results.json, e2e.md,
# e2e.png; ablations.json, ablations.md, ablations.png) and the log to $OUT/log.txt: 7 files.
# Needs MLX's CUDA build importable (docs/benchmarks.md, "On the NVIDIA H200").
set -uo pipefail
cd "$(dirname "$0")/.."
PLAN=0
BUDGET=480
case "${1:-}" in
  --plan) PLAN=1;;
  "") ;;
  *) BUDGET=$1;;
esac
START=$(date +%s)
STOP_AT=$((START + BUDGET))
STATE=${PLAN_STATE:-/root/lily_plan}
SEED=${PLAN_SEED:-out/plan}
OUT=${OUT:-$PWD/device_out}
PY=${PYTHON:-python3}
export LILY_BACKEND=${LILY_BACKEND:-cuda} LILY_TUNE=off PYTHONUNBUFFERED=1
# Compiled kernels kept on disk: a later process (and a later call on the same machine) skips NVRTC.
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$HOME/.cache/lily-mlx-ptx}
mkdir -p "$OUT/plan"
LOG=${PLAN_LOG:-$OUT/log.txt}
# PLAN_PARTS="sweep" / "ablations": one part only, e.g. one per GPU of a two-GPU host, each process with its
# own CUDA_VISIBLE_DEVICES, PLAN_LOG and MLX_PTX_CACHE_DIR (two writers must not share one cache file).
PARTS=" ${PLAN_PARTS:-sweep ablations} "

# The sweep: the write-up's 10 prompt lengths and 10 decode contexts, stock / stock-kernels / lily; every
# decode from one cache per round prefilled by lily; stock prefills only up to 16K (~270 tok/s on CUDA).
SWEEP=(--mode e2e --size full --engines stock,stock-kernels,lily --shared-prefill --max-prefill-length stock=16K
       --rounds 2 --long-from 16K --long-rounds 1 --gen-tokens 64)
# The ablation table: prefill switches 3 rounds; decode switches by decode-profile, 4 rounds (2 from 32K).
ABLATIONS=(--size full --rounds 3 --decode-rounds 4 --long-rounds 2 --profile-steps 32)
# Tests on a CPU: extra arguments for each tool (the last of a repeated option wins), e.g.
# PLAN_SWEEP_EXTRA="--size tiny --num-layers 4 --lengths 64,128" PLAN_ABLATIONS_EXTRA="--size tiny --lengths-scale 0.01".
read -r -a SWEEP_EXTRA <<< "${PLAN_SWEEP_EXTRA:-}"
read -r -a ABLATIONS_EXTRA <<< "${PLAN_ABLATIONS_EXTRA:-}"
SWEEP+=("${SWEEP_EXTRA[@]}")
ABLATIONS+=("${ABLATIONS_EXTRA[@]}")

if [ "$PLAN" = 1 ]; then
  [ -d "$STATE" ] || STATE=$SEED
  $PY -m bench.run "${SWEEP[@]}" --out "$STATE/sweep" --plan
  $PY -m bench.ablations "${ABLATIONS[@]}" --out "$STATE/ablations" --plan --plan-backend "$LILY_BACKEND"
  exit 0
fi

for part in sweep ablations; do  # a fresh machine: continue from the copy that came with the working tree
  if [ ! -d "$STATE/$part" ] && [ -d "$SEED/$part" ]; then
    mkdir -p "$STATE/$part" && cp -r "$SEED/$part/." "$STATE/$part/"
  fi
done
mkdir -p "$STATE"
say() { echo "[device_plan $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
say "budget ${BUDGET}s (stop at $STOP_AT), state $STATE, LILY_BACKEND=$LILY_BACKEND"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true; } | tee -a "$LOG"
# --stop-at keeps each tool inside the budget; the timeout (45 s later) is only a guard: the results
# files are written whole after every length / ablation, so a kill loses the one in progress at most.
guard() { local g=$(( STOP_AT + 45 - $(date +%s) )); echo $(( g > 1 ? g : 1 )); }
if [[ "$PARTS" == *" sweep "* ]]; then
  timeout --signal=INT --kill-after=15 "$(guard)" $PY -m bench.run "${SWEEP[@]}" --stop-at "$STOP_AT" --out "$STATE/sweep" 2>&1 | tee -a "$LOG"
fi
if [[ "$PARTS" == *" ablations "* ]] && [ $(( STOP_AT - $(date +%s) )) -gt 60 ]; then
  timeout --signal=INT --kill-after=15 "$(guard)" $PY -m bench.ablations "${ABLATIONS[@]}" --stop-at "$STOP_AT" \
    --out "$STATE/ablations" 2>&1 | tee -a "$LOG"
fi
for part in sweep ablations; do
  mkdir -p "$OUT/plan/$part"
  for f in results.json e2e.md e2e.png ablations.json ablations.md ablations.png; do
    [ -f "$STATE/$part/$f" ] && cp "$STATE/$part/$f" "$OUT/plan/$part/"
  done
done
status=$($PY - "$STATE" <<'EOF'
import json, sys
from pathlib import Path
state = Path(sys.argv[1])
def done(path, key):
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return bool((data.get(key) or {}).get("complete") if key else data.get("complete"))
sweep = done(state / "sweep" / "results.json", "e2e")
ablations = done(state / "ablations" / "ablations.json", None)
print("complete" if sweep and ablations else
      f"incomplete (sweep {'done' if sweep else 'not done'}, ablations {'done' if ablations else 'not done'}): "
      "repeat this command")
EOF
)
say "plan: $status ($(( $(date +%s) - START )) s)"
