#!/usr/bin/env bash
# Two independent GPU jobs at once on a two-GPU host, one per GPU: half the device time for work that
# is not timed against each other (a sweep on one GPU, kernel tests or an ablation table on the other).
#
#   bash bench/device_pair.sh "COMMAND_FOR_GPU_0" "COMMAND_FOR_GPU_1"
#
# Each command runs in its own bash with CUDA_VISIBLE_DEVICES set to its GPU, its own MLX_PTX_CACHE_DIR
# (two processes must not write one cache file at once; kept across calls on the same machine) and its
# output in $OUT/gpu0.txt / $OUT/gpu1.txt as it runs; a progress line every 30 s; the exit status is
# the first failing job's. Results that two jobs share the host's CPU and PCIe: say so with the
# numbers (a busy neighbour slows host-bound steps such as decode).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 2 ]; then
  echo "usage: bash bench/device_pair.sh \"COMMAND_FOR_GPU_0\" \"COMMAND_FOR_GPU_1\"" >&2
  exit 2
fi
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
say() { echo "[device_pair $(date -u +%H:%M:%S)] $*" | tee -a "$OUT/pair_log.txt"; }
pids=()
for gpu in 0 1; do
  cmd=$([ "$gpu" = 0 ] && echo "$1" || echo "$2")
  say "GPU $gpu: $cmd"
  ( export CUDA_VISIBLE_DEVICES=$gpu MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$HOME/.cache/lily-mlx-ptx}-gpu$gpu
    bash -c "$cmd" > "$OUT/gpu$gpu.txt" 2>&1 ) &
  pids+=($!)
done
tick=0
while kill -0 "${pids[0]}" 2>/dev/null || kill -0 "${pids[1]}" 2>/dev/null; do
  sleep 5
  tick=$((tick + 1))
  if [ $((tick % 6)) = 0 ]; then
    say "GPU 0: $(tail -n 1 "$OUT/gpu0.txt" 2>/dev/null | cut -c1-120) | GPU 1: $(tail -n 1 "$OUT/gpu1.txt" 2>/dev/null | cut -c1-120)"
  fi
done
status=0
for gpu in 0 1; do
  wait "${pids[$gpu]}"
  rc=$?
  say "GPU $gpu exited with status $rc"
  [ "$status" = 0 ] && status=$rc
done
exit "$status"
