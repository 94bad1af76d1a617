# Sourced by the one-GPU device scripts (bench/device_decode_checks.sh, bench/device_register_tiles.sh): a time
# budget for one device call and a runner that starts nothing that would not fit it. The sourcing script sets
# TAG (the log prefix), W (its output folder, created here) and BUDGET (seconds, default 540).
mkdir -p "$W"
export LILY_TUNE=off PYTHONUNBUFFERED=1 LILY_BACKEND=${LILY_BACKEND:-cuda}
# compiled kernels under $KC (bench/device_kernel_cache.sh: saved at the end of a call, restored on the next machine)
[ -n "${MLX_PTX_CACHE_DIR:-}" ] || eval "$(bash "$(dirname "${BASH_SOURCE[0]}")/device_kernel_cache.sh" env)"
BUDGET=${BUDGET:-540}
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
say() { echo "[$TAG $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$W/log.txt"; }
run() {  # run NAME NEEDED_SECONDS COMMAND...: only when NEEDED_SECONDS still fit the budget
  local name=$1 need=$2; shift 2
  if [ "$(left)" -lt "$need" ]; then say "skipped $name (needs ~${need}s, $(left)s left)"; return; fi
  say "start $name"
  timeout "$(left)" "$@" > "$W/$name.txt" 2>&1
  say "end $name (exit $?)"
}
