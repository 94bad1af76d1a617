#!/usr/bin/env bash
# The decode checks left by the session of 2026-12-01 (docs/benchmarks.md, "Next device session"), on one
# NVIDIA GPU, in three calls of under 10 minutes each (`PART=1`, `2`, `3`; each stops starting work that
# would end after its budget and says what it skipped):
#
#   PART=1 bash bench/device_decode_checks.sh   # CUDA tests of what has not run on a GPU, decode A/B
#   PART=2 bash bench/device_decode_checks.sh   # step GPU time by engine (Nsight Compute)
#   PART=3 bash bench/device_decode_checks.sh   # decode profile (primitives, build, eval) + host profile
#   PART=4 bash bench/device_decode_checks.sh   # layer_replay: CUDA tests of the traced steps, decode A/B
#                                               # (lily, lily-off:layer_replay, stock-kernels), e2e decode
#   PART=5 bash bench/device_decode_checks.sh   # decode driven three ways (bursts, bursts in MLX-LM's generation
#                                               # stream, generate_step), then ncu's full sections of one decode
#                                               # step's kernels in the first DeltaNet and MoE layer
#   PART=6 bash bench/device_decode_checks.sh   # the decode kernels' loads (16-byte DeltaNet state, loads
#                                               # hoisted): CUDA tests, step GPU time by kernel, decode A/B
#   PART=7 bash bench/device_decode_checks.sh   # where the e2e decode loses against the bursts: the bursts,
#                                               # generate_step, generate_step from a fresh cache copy and the
#                                               # e2e harness's decode side by side; e2e with 256 decode tokens
#   PART=8 bash bench/device_decode_checks.sh   # fused_down_combine (the down GEMVs and the combine in one
#                                               # kernel): step GPU time on/off, decode A/B, CUDA tests
#   PART=9 bash bench/device_decode_checks.sh   # the fused kernel's GPU time on/off, then where a decode step's
#                                               # build goes on this host: one mx.compile trace call by captured
#                                               # arrays and ops (bench.host_speed --traces) against lily's layer
#                                               # replays (their us and graph nodes a call)
#   PART=10 bash bench/device_decode_checks.sh  # the eighteenth session's candidates kernel against kernel (same
#                                               # bits as the product's forms): the direct down+combine layout, the
#                                               # attention's query heads over two threadgroups, the register tile
#                                               # without a stack frame (docs/benchmarks.md, items 1, 2 and 4)
#   PART=11 bash bench/device_decode_checks.sh  # kv_write_in_trace (the KV cache written inside the attention
#                                               # layer's first trace): CUDA tests of the traced steps, decode A/B,
#                                               # decode profile (build ms, primitives), e2e decode of 256 tokens
#   PART=12 bash bench/device_decode_checks.sh  # the fixed-block kernels' live-length form: CUDA tests, then kernel
#                                               # against kernel over a KV buffer with spare rows (4K-128K)
#   PART=13 bash bench/device_decode_checks.sh  # the traced steps with the gate in the merge (CUDA test), then
#                                               # kv_write_in_trace with the live form's schedule: A/B, e2e
#   PART=14 bash bench/device_decode_checks.sh  # one_trace_attention: CUDA tests of the traced steps, decode A/B,
#                                               # decode profile on/off with the host profile's replay anatomy
#   PART=15 bash bench/device_decode_checks.sh  # the down+combine kernel's direct layout against the staged one:
#                                               # CUDA tests, GPU time a decode step with each (Nsight Compute)
#   PART=16 bash bench/device_decode_checks.sh  # the KV row written by a scatter: equal to the slice update on the
#                                               # GPU, GPU time a decode step, e2e decode at 4K / 32K on/off
#   PART=17 bash bench/device_decode_checks.sh  # e2e decode at 32K / 128K: lily, gqa_packing and
#                                               # fixed_block_attention off, the fair baseline (issue 13's rows)
#   PART=18 bash bench/device_decode_checks.sh  # GPU time of a decode step at 32K and 128K (Nsight Compute): the
#                                               # live-length attention's kernel time against the copy ceiling
#   PART=19 bash bench/device_decode_checks.sh  # device_positions (the step's position made on the GPU): CUDA tests,
#                                               # GPU time a step at 4K on/off and with the constant inputs narrow
#                                               # again (clocks and caches left alone), decode A/B
#   PART=20 bash bench/device_decode_checks.sh  # the live form's 8-simdgroup threadgroups: CUDA tests, GPU time a
#                                               # step (clocks and caches left alone) at 4K wide and 128K narrow
#                                               # against the default, and 32K
#   PART=21 bash bench/device_decode_checks.sh  # e2e decode at 32K / 64K / 128K with stock on CUDA ops too (issue
#                                               # 13's rows: lily, gqa_packing and fixed_block_attention off, both
#                                               # stocks), one round
#   PART=22 bash bench/device_decode_checks.sh  # the dense projections by lily's row GEMV (trial linear_gemv)
#                                               # against MLX's qmv: CUDA tests, GPU time a step, decode A/B
#   PART=23 bash bench/device_decode_checks.sh  # constant_weights (layer weights as trace constants): CUDA
#                                               # tests, decode A/B, decode profile, all with it on at patch time
#   PART=24 bash bench/device_decode_checks.sh  # step_trace (the whole decode step as one trace) with
#                                               # constant_weights: CUDA tests (with the GEMV's), decode A/B
#   PART=25 bash bench/device_decode_checks.sh  # step_trace: decode profile (build / eval), e2e decode 4K / 32K
#   PART=26 bash bench/device_decode_checks.sh  # gqa_packing at 32K: the attention kernels' GPU time packed
#                                               # and unpacked (issue 13's 1.15x)
#   PART=27 bash bench/device_decode_checks.sh  # prompt chunks of 4,096 tokens against 2,048 in one process
#                                               # (lily@chunk-4096), prefill and peak memory with the fair baseline
#   PART=28 bash bench/device_decode_checks.sh  # the matrix-tile decode attention partials (candidate): CUDA
#                                               # tests, then lily_dev.live_check at 4K / 32K / 128K against the
#                                               # live form
#   PART=29 bash bench/device_decode_checks.sh  # the gate+up GEMV's K-split candidate (each sum as SK chains):
#                                               # op cases against the staged GEMV (issue 12's 80 %), the register
#                                               # tiles with the same split (prefill's cost), CUDA tests
#   PART=30 bash bench/device_decode_checks.sh  # switch split_k_gate_up (the split in the product's routed GEMV
#                                               # and the register tiles): CUDA tests, decode A/B, e2e on / off
#   PART=31 bash bench/device_decode_checks.sh  # decode over a quantized KV cache (op attention_decode_quantized):
#                                               # CUDA tests, kernels against stock's quantized attention at
#                                               # 4K-128K, 4 and 8 bits, decode at 32K over a 4-bit and a plain cache
#   PART=32 bash bench/device_decode_checks.sh  # the merge's one MW: live_check (MW 8 / 32, 2x rows), e2e decode
#                                               # 4K / 32K two rounds (round 1 no longer compiles a merge)
#   PART=33                                     # (switch long_live_blocks, removed after this part's A/B on
#                                               # 2026-12-05: docs/results/2026-12-05-h200-server-batch/)
#   PART=34 bash bench/device_decode_checks.sh  # issue 12's expert GEMVs: K chunks of 512 and gate+up's direct
#                                               # layout against the staged ones (op cases, a 4K step's GPU time)
#   PART=35 bash bench/device_decode_checks.sh  # Nsight Compute's sections and stall samples of the routed
#                                               # gate+up GEMV and the down+combine at 4K
#   PART=36 bash bench/device_decode_checks.sh  # switch direct_down_combine: decode A/B on / off at 4K and 32K
#   PART=37 bash bench/device_decode_checks.sh  # op attention_decode_batch (a server batch's rows): CUDA tests, then
#                                               # kernel time against stock's masked attention at 4K-128K (with the
#                                               # schedule's candidates: fewer blocks a row, 4 simdgroups)
#   PART=38 bash bench/device_decode_checks.sh  # a server's batch decoded end to end: lily against lily with stock's
#                                               # masked attention and the fair baseline, rows of 32K-4K and 8K-1K
#   PART=39 bash bench/device_decode_checks.sh  # the down+combine's schedule in the step: CUDA tests, a 4K step's
#                                               # GPU time by kernel with down_combine_ring on / off, with
#                                               # down_combine_simd_barriers on / off
#   PART=40 bash bench/device_decode_checks.sh  # the down+combine with 8 chunks in flight, with 8 columns a
#                                               # threadgroup (step GPU time); down_combine_ring: decode A/B on / off
#                                               # in bursts at 4K and 32K
#   PART=41 bash bench/device_decode_checks.sh  # down_combine_simd_barriers: decode A/B at 4K; its stall samples
#   PART=42 bash bench/device_decode_checks.sh  # a batch step's build on this host; the batch split's aims at
#                                               # batches of 1 / 2 / 4 / 8 rows (op cases)
#   PART=43 bash bench/device_decode_checks.sh  # the routed gate+up with 2 / 4 / 8 chunks in flight (step GPU time)
#   PART=44 bash bench/device_decode_checks.sh  # the trial row GEMV with each layer's input norm inside it
#                                               # (gemv_input_norm), the DeltaNet in-projection inside its step
#                                               # (fused_in_proj_step), the attention q/k/v projection inside its
#                                               # q/k preparation (fused_qkv_prep): CUDA tests, step GPU time
#   PART=45 bash bench/device_decode_checks.sh  # PART=44's engines: decode A/B at 4K, decode profile
#   PART=46 bash bench/device_decode_checks.sh  # the trial row GEMV in today's defaults: decode A/B at 4K, profile
#   PART=47 bash bench/device_decode_checks.sh  # fused_output_gate in bursts at 4K / 32K; the down+combine at 8 in
#                                               # flight and at 8 columns a threadgroup (step GPU time)
#   PART=48 bash bench/device_decode_checks.sh  # a launch's host cost on this host (bench.launch_cost), then
#                                               # gqa_packing on / off in alternating bursts at 32K (issue 13's 1.15x)
#
# Engines compared with lily (ENGINES overrides): lily-off:fused_add_norm, lily-off:fused_topk_gemv and
# lily-off:fused_qk_prep. Results under $OUT/decode_checks (Markdown tables, JSON, logs).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}
W=$OUT/decode_checks
TAG=decode_checks
. bench/device_budget.sh
ENGINES=${ENGINES:-lily,lily-off:fused_add_norm,lily-off:fused_topk_gemv,lily-off:fused_qk_prep}
# The trial row GEMV's forms (PART=44, 45): with the input norm inside and the projections inside the kernels after them
# (the DeltaNet in-projection in its step, the attention q/k/v projection in its q/k preparation), without the latter,
# without both. gemv_input_norm and fused_in_proj_step are off by default since these parts ran (H100, 2026-12-05:
# docs/results/2026-12-05-h100-folds-timed/), so the parts turn them on for the process (FOLD_SWITCHES)
FOLD_SWITCHES=gemv_input_norm,fused_in_proj_step
GEMV_ENGINES="lily-trial:linear_gemv,lily-trial:linear_gemv@off-fused_in_proj_step+fused_qkv_prep"
GEMV_ENGINES="$GEMV_ENGINES,lily-trial:linear_gemv@off-fused_in_proj_step+fused_qkv_prep+gemv_input_norm"
down_combine_forms() {  # a 4K step's GPU time as shipped, then with the down+combine at 8 chunks in flight and at 8
  # columns a threadgroup (each its own process: --set applies to the whole process; the first is their baseline)
  run sgt_default 100 python -m bench.step_gpu_time --compare lily --clock-control none --cache-control none \
    --out "$W/sgt_default"
  grep -E "^\| lily|down_combine" "$W/sgt_default/step_gpu_time.md" 2>/dev/null | head -6
  run sgt_ring8 100 python -m bench.step_gpu_time --compare lily \
    --set lily_mlx.ops.moe.kernels.DOWN_COMBINE_IN_FLIGHT=8 --clock-control none --cache-control none --out "$W/sgt_ring8"
  grep -E "^\| lily|down_combine" "$W/sgt_ring8/step_gpu_time.md" 2>/dev/null | head -6
  run sgt_rows8 100 python -m bench.step_gpu_time --compare lily --set lily_mlx.ops.moe.kernels.DOWN_COMBINE_ROWS=8 \
    --clock-control none --cache-control none --out "$W/sgt_rows8"
  grep -E "^\| lily|down_combine" "$W/sgt_rows8/step_gpu_time.md" 2>/dev/null | head -6
  rm -f "$W"/sgt_*/*.csv
}
switch_ab() {  # switch_ab NAME NEEDED_SECONDS SWITCH CONTEXT BURSTS: decode in alternating bursts, a switch that is off
  # by default turned on for the process (lily) against its off state (lily-off:SWITCH), one prefill
  local name=$1 need=$2 sw=$3 context=$4 bursts=$5
  run "$name" "$need" env LILY_ENABLE="$sw" python -m bench.decode_ab --engines "lily,lily-off:$sw" \
    --context "$context" --bursts "$bursts" --out "$W/$name"
  tail -8 "$W/$name.txt" 2>/dev/null
}
case "${PART:-1}" in
  1)
    run tests_cuda 150 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider \
      -o addopts= tests/kernels/test_moe_kernels.py tests/kernels/test_compiled_decode.py \
      -k "residual or traces or top_k_inside or small_calls or decode_plan"
    tail -3 "$W/tests_cuda.txt" 2>/dev/null
    run decode_ab 200 python -m bench.decode_ab --engines "$ENGINES" --context 4096 --bursts 10 --out "$W/ab"
    cat "$W/ab/decode_ab.md" 2>/dev/null
    ;;
  2)
    run step_gpu_time 300 python -m bench.step_gpu_time --compare "$ENGINES" --out "$W/sgt"
    head -9 "$W/sgt/step_gpu_time.md" 2>/dev/null
    rm -f "$W"/sgt/*.csv
    ;;
  3)
    run decode_profile 300 python -m bench.run --mode decode-profile --size full --context 4096 --rounds 2 \
      --profile-steps 12 --engines "stock-kernels,$ENGINES" --host-profile lily --out "$W/dprof"
    head -12 "$W/dprof/decode_profile.md" 2>/dev/null
    ;;
  4)
    run tests_cuda 240 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider \
      -o addopts= tests/kernels/test_compiled_decode.py
    grep -v "TMA\|cuTensorMap" "$W/tests_cuda.txt" | tail -3
    run decode_ab 200 python -m bench.decode_ab --engines lily,lily-off:layer_replay,stock-kernels --context 4096 \
      --bursts 8 --out "$W/ab_replay"
    cat "$W/ab_replay/decode_ab.md" 2>/dev/null
    run e2e_decode 150 python -m bench.run --mode e2e --size full --engines stock-kernels,lily --shared-prefill \
      --lengths 512,4K --rounds 2 --gen-tokens 64 --out "$W/e2e_decode"
    cat "$W/e2e_decode/e2e.md" 2>/dev/null
    ;;
  5)  # why generate_step decodes slower than the bursts (both engines), and what bounds each decode kernel
    run decode_drivers 200 python -m bench.decode_ab --engines lily,stock-kernels --drivers bursts,stream,generate-step \
      --context 4096 --bursts 6 --burst-steps 16 --out "$W/drivers"
    cat "$W/drivers/decode_ab.md" 2>/dev/null
    run ncu_decode 240 ncu --profile-from-start off --set full -c 7 \
      -k "regex:deltanet_decode_conv_fused|router_logits|gate_up|gemv_down|combine_weighted|qmv" \
      python -m bench.step_gpu_time --engine lily --context 4096 --steps 1
    grep -E "custom_kernel|qmv|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Size|Grid Size|Memory Throughput|DRAM Throughput|Warp Cycles Per Issued|Issue Slots Busy|Stall" \
      "$W/ncu_decode.txt" | head -120
    ;;
  6)  # the decode kernels' loads: 16-byte DeltaNet state accesses, the router's row and the combine's
      # independent loads issued first (same bits): CUDA tests, GPU time per step by kernel, decode A/B
    run tests_cuda 150 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider \
      -o addopts= tests/kernels/test_deltanet_kernels.py tests/kernels/test_moe_kernels.py \
      -k "scan_kernels_match or decode_kernels_match or decode_conv_fused or qwen36 or combine or norm_router"
    grep -v "TMA\|cuTensorMap" "$W/tests_cuda.txt" | tail -3
    run step_gpu_time 200 python -m bench.step_gpu_time --compare lily --out "$W/sgt_loads"
    head -30 "$W/sgt_loads/step_gpu_time.md" 2>/dev/null
    rm -f "$W"/sgt_loads/*.csv
    run decode_ab 150 python -m bench.decode_ab --engines lily,stock-kernels --context 4096 --bursts 8 \
      --out "$W/ab_loads"
    cat "$W/ab_loads/decode_ab.md" 2>/dev/null
    ;;
  7)  # the e2e decode's ~30 % loss against the bursts (both engines): which step of the harness's decode costs it,
      # and whether it is paid once per request (then 256 decode tokens dilute it) or every token
    run decode_drivers 240 python -m bench.decode_ab --engines lily,stock-kernels \
      --drivers bursts,generate-step,copy,e2e --context 4096 --bursts 6 --burst-steps 16 --out "$W/drivers_e2e"
    cat "$W/drivers_e2e/decode_ab.md" 2>/dev/null
    run e2e_decode_256 200 python -m bench.run --mode e2e --size full --engines stock-kernels,lily --shared-prefill \
      --lengths 4K --rounds 2 --gen-tokens 256 --out "$W/e2e_256"
    cat "$W/e2e_256/e2e.md" 2>/dev/null
    ;;
  8)  # the down GEMVs and the combine in one kernel (same bits): GPU time per step by kernel with the switch on and
      # off, decode A/B against the off state and the fair baseline, then the CUDA tests (they passed on 2026-12-03)
    run step_gpu_time 200 python -m bench.step_gpu_time --compare lily,lily-off:fused_down_combine --out "$W/sgt_dc"
    head -40 "$W/sgt_dc/step_gpu_time.md" 2>/dev/null
    rm -f "$W"/sgt_dc/*.csv
    run decode_ab 150 python -m bench.decode_ab --engines lily,lily-off:fused_down_combine,stock-kernels \
      --context 4096 --bursts 8 --out "$W/ab_dc"
    cat "$W/ab_dc/decode_ab.md" 2>/dev/null
    run tests_cuda 140 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider \
      -o addopts= tests/kernels/test_moe_kernels.py -k "down_combine or down_gemv_with or small_calls or residual_equals"
    grep -v "TMA\|cuTensorMap" "$W/tests_cuda.txt" | tail -3
    ;;
  9)  # the shipped fused kernel's GPU time (item 1 of the seventeenth session's list), then the build's cost
      # model on this host: is a layer replay's time its trace call's fixed cost, its captured weights or its nodes?
    run step_gpu_time 200 python -m bench.step_gpu_time --compare lily,lily-off:fused_down_combine --out "$W/sgt_dc"
    head -40 "$W/sgt_dc/step_gpu_time.md" 2>/dev/null
    rm -f "$W"/sgt_dc/*.csv
    run host_traces 60 python -m bench.host_speed --traces
    cat "$W/host_traces.txt" 2>/dev/null
    run host_profile 240 python -m bench.run --mode decode-profile --size full --context 4096 --rounds 1 \
      --profile-steps 12 --engines lily --host-profile lily --out "$W/hprof"
    head -12 "$W/hprof/decode_profile.md" 2>/dev/null
    ls "$W/hprof"
    ;;
  10) # the candidates of docs/benchmarks.md (2026-12-04): op cases (down_combine_direct_x8 against the default
      # layout and the two kernels; attention_fixed_blocks_auto_gt4 against auto, 4K-128K), then the GEMM tile forms
      # (gate_up register, 64 threads, with and without its staged columns in registers)
    run op_cases 300 python -m bench.run --mode kernels --op-cases on --op-match "combine_|attention_fixed_blocks_auto" \
      --out "$W/candidates"
    grep -E "down_|combine_|attention_fixed" "$W/op_cases.txt" | tail -40
    run gemm_tiles 200 python -m bench.gemm_tiles --variants --tokens 512,2048,8192 --out "$W/candidates_gemm_tiles.md"
    cat "$W/candidates_gemm_tiles.md" 2>/dev/null
    ;;
  11) # the KV cache written and attended inside the attention layers' first trace (nothing built between their two
      # traces): the CUDA tests of the traced steps (traced == built bits; on == off up to the GPU's sums), the
      # decode A/B and profile against the switch off, e2e decode of 256 tokens (crosses the buffer's growth)
    run tests_cuda 150 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider \
      -o addopts= tests/kernels/test_compiled_decode.py
    grep -v "TMA\|cuTensorMap" "$W/tests_cuda.txt" | tail -3
    run decode_ab 150 python -m bench.decode_ab --engines lily,lily-off:kv_write_in_trace,stock-kernels \
      --context 4096 --bursts 8 --out "$W/ab_kv"
    cat "$W/ab_kv/decode_ab.md" 2>/dev/null
    run decode_profile 150 python -m bench.run --mode decode-profile --size full --context 4096 --rounds 1 \
      --profile-steps 12 --engines lily,lily-off:kv_write_in_trace --out "$W/dprof_kv"
    head -8 "$W/dprof_kv/decode_profile.md" 2>/dev/null
    run e2e_decode_256 150 python -m bench.run --mode e2e --size full --engines lily,lily-off:kv_write_in_trace \
      --shared-prefill --lengths 4K --rounds 2 --gen-tokens 256 --out "$W/e2e_kv"
    cat "$W/e2e_kv/e2e.md" 2>/dev/null
    ;;
  12) # the fixed-block kernels' live-length form (what kv_write_in_trace attends with where the long-context op has
      # kernels): its CUDA tests, then kernel against kernel over a buffer with 256 spare rows, 4K-128K (against
      # stock's masked attention over the buffer, the fixed-block kernels over the live rows, stock's SDPA over them)
    run tests_cuda 150 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider \
      -o addopts= tests/kernels/test_attention_kernels.py -k "live_length or fixed_block_kernels_match"
    grep -v "TMA\|cuTensorMap" "$W/tests_cuda.txt" | tail -3
    run op_cases 240 python -m bench.run --mode kernels --op-cases on \
      --op-match "attention_in_buffer|attention_fixed_blocks_live|attention_fixed_blocks_auto_x8|attention_stock_sdpa_x8" \
      --out "$W/live"
    grep -E "attention_" "$W/op_cases.txt" | tail -24
    ;;
  13) # after the twentieth session (docs/benchmarks.md, item 1): the traced steps over the KV buffer with the output
      # gate in the merge on the GPU, then kv_write_in_trace (on by default) with the live form's schedule of twice the
      # rows a block: decode A/B and e2e decode of 512 tokens at 512 / 4K / 32K
    run tests_cuda 240 env LILY_ENABLE=fused_output_gate LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q \
      -p no:cacheprovider -o addopts= tests/kernels/test_compiled_decode.py -k kv_buffer
    grep -v "TMA\|cuTensorMap" "$W/tests_cuda.txt" | tail -3
    run decode_ab 120 python -m bench.decode_ab --engines lily,lily-off:kv_write_in_trace,stock-kernels \
      --context 4096 --bursts 6 --out "$W/ab_live"
    cat "$W/ab_live/decode_ab.md" 2>/dev/null
    run e2e_decode_512 200 python -m bench.run --mode e2e --size full --engines lily,lily-off:kv_write_in_trace \
      --shared-prefill --lengths 512,4K,32K --rounds 2 --gen-tokens 512 --out "$W/e2e_live"
    cat "$W/e2e_live/e2e.md" 2>/dev/null
    ;;
  14) # one_trace_attention (an attention layer's decode step over the KV buffer in one trace instead of two): CUDA
      # tests of the traced steps, decode A/B on/off with the fair baseline, then the decode profile on/off with the
      # host profile's replay anatomy (us a layer's replay by kind)
    run tests_cuda 200 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider \
      -o addopts= tests/kernels/test_compiled_decode.py -k "equal_built or equals_built"
    grep -v "TMA\|cuTensorMap" "$W/tests_cuda.txt" | tail -3
    run decode_ab 150 python -m bench.decode_ab --engines lily,lily-off:one_trace_attention,stock-kernels \
      --context 4096 --bursts 8 --out "$W/ab_one_trace"
    cat "$W/ab_one_trace/decode_ab.md" 2>/dev/null
    run decode_profile 200 python -m bench.run --mode decode-profile --size full --context 4096 --rounds 1 \
      --profile-steps 12 --engines lily,lily-off:one_trace_attention --host-profile lily --out "$W/dprof_one_trace"
    head -8 "$W/dprof_one_trace/decode_profile.md" 2>/dev/null
    ;;
  15) # the down+combine kernel's direct layout (every load of a chain's weight row issued before its first sum, no
      # staging, no barrier a chunk; same bits) against the staged layout by GPU time a decode step: CUDA tests of both,
      # then Nsight Compute's step time with each (switch direct_down_combine since 2026-12-05)
    run tests_cuda 180 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider \
      -o addopts= tests/kernels/test_moe_kernels.py -k "down_combine or down_gemv_with"
    grep -v "TMA\|cuTensorMap" "$W/tests_cuda.txt" | tail -3
    run sgt_staged 200 python -m bench.step_gpu_time --compare lily --out "$W/sgt_staged"
    grep -E "^\| lily|down_combine" "$W/sgt_staged/step_gpu_time.md" 2>/dev/null | head -4
    run sgt_direct 200 env LILY_ENABLE=direct_down_combine python -m bench.step_gpu_time --compare lily \
      --out "$W/sgt_direct"
    grep -E "^\| lily|down_combine" "$W/sgt_direct/step_gpu_time.md" 2>/dev/null | head -4
    rm -f "$W"/sgt_*/*.csv
    ;;
  16) # the KV row written by a scatter (layer.write_row) instead of a dynamic slice update (whose CUDA copy launches
      # over the whole buffer): the two against each other on this GPU, then GPU time a decode step, then e2e decode at
      # 4K and 32K against the live rows' path (kv_write_in_trace off)
    run write_row 60 python -c "
import mlx.core as mx
from lily_mlx.ops.attention.layer import write_row
for cap, pos in ((5120, 4095), (33792, 33000), (64, 0)):
    buf = mx.random.normal((1, 2, cap, 256)).astype(mx.bfloat16); row = mx.random.normal((1, 2, 1, 256)).astype(mx.bfloat16)
    p = mx.array(pos, dtype=mx.int32)
    want = mx.slice_update(buf, row, p.reshape(1), axes=(2,)); got = write_row(buf, row, p)
    print(cap, pos, 'equal' if mx.array_equal(got, want).item() else 'DIFFERENT')"
    cat "$W/write_row.txt"
    run sgt_scatter 200 python -m bench.step_gpu_time --compare lily --out "$W/sgt_scatter"
    head -16 "$W/sgt_scatter/step_gpu_time.md" 2>/dev/null | tail -12
    rm -f "$W"/sgt_*/*.csv
    run e2e_scatter 240 python -m bench.run --mode e2e --size full --engines lily,lily-off:kv_write_in_trace \
      --shared-prefill --lengths 4K,32K --rounds 2 --gen-tokens 256 --out "$W/e2e_scatter"
    cat "$W/e2e_scatter/e2e.md" 2>/dev/null
    ;;
  17) # issue 13's e2e rows with the KV row written by a scatter: decode at 32K and 128K from one cache prefilled by
      # lily, lily against gqa_packing and fixed_block_attention off and the fair baseline (those three decode only)
    # (--stop-at: a length that would not finish is not started and results.json keeps the finished ones; each device
    # call starts with an empty $OUT, so a second call runs the lengths left, e.g. with --lengths 128K)
    run e2e_long 280 python -m bench.run --mode e2e --size full \
      --engines lily,lily-off:gqa_packing,lily-off:fixed_block_attention,stock-kernels --shared-prefill \
      --max-prefill-length "lily-off:gqa_packing=1K,lily-off:fixed_block_attention=1K,stock-kernels=1K" \
      --lengths 32K,128K --rounds 2 --long-from 64K --long-rounds 1 --gen-tokens 256 --out "$W/e2e_long" \
      --stop-at $(( $(date +%s) + $(left) - 15 ))
    cat "$W/e2e_long/e2e.md" 2>/dev/null
    ;;
  18) # the live-length attention's kernel time at long context (issue 13's 70 % of copy): Nsight Compute's table of
      # a decode step at 32K and at 128K (bytes a step: 10 layers x K and V x live rows x 2 KV heads x 256 x 2 bytes)
    run sgt_32k 200 python -m bench.step_gpu_time --compare lily --context 32768 --out "$W/sgt_32k"
    grep -E "^\| lily|attention_decode|attention kernels" "$W/sgt_32k/step_gpu_time.md" 2>/dev/null | head -5
    run sgt_128k 280 python -m bench.step_gpu_time --compare lily --context 131072 --out "$W/sgt_128k"
    grep -E "^\| lily|attention_decode|attention kernels" "$W/sgt_128k/step_gpu_time.md" 2>/dev/null | head -5
    rm -f "$W"/sgt_*/*.csv
    ;;
  19) # device_positions: the step's position array made on the GPU from the last step's, 16 bytes (device memory),
      # instead of a 4-byte scalar the host writes (MLX's managed pool of small arrays); Nsight Compute saw the live
      # partials wait on that load (docs/results/2026-12-04-h200-long-context-decode/, part 5)
    run tests_cuda 150 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider -o addopts= \
      tests/kernels/test_compiled_decode.py -k "device_positions or equal_built"
    tail -3 "$W/tests_cuda.txt"
    run sgt_positions_off 150 python -m bench.step_gpu_time --compare lily --clock-control none --cache-control none --out "$W/sgt_positions_off"
    run sgt_positions_on 120 env LILY_ENABLE=device_positions python -m bench.step_gpu_time --compare lily \
      --clock-control none --cache-control none --out "$W/sgt_positions_on"
    # the constant kernel inputs as they were before (1 element: in MLX's managed pool of small arrays)
    run sgt_constants_narrow 120 python -m bench.step_gpu_time --compare lily --clock-control none --cache-control none \
      --set lily_mlx.core.kernel_registry.CONSTANT_MIN_ELEMENTS=1 --out "$W/sgt_constants_narrow"
    for f in "$W"/sgt_positions_*/step_gpu_time.md "$W"/sgt_constants_narrow/step_gpu_time.md; do
      echo "$f"; grep -E "^\| lily|partials|merge|scatter|router|down_combine|gate_up" "$f" | head -8; done
    rm -f "$W"/sgt_*/*.csv
    run decode_ab 150 env LILY_ENABLE=device_positions python -m bench.decode_ab \
      --engines lily,lily-off:device_positions,stock-kernels --context 4096 --bursts 8 --out "$W/decode_ab"
    tail -8 "$W/decode_ab.txt"
    ;;
  20) # the live form's partials in 8-simdgroup threadgroups on CUDA from 32K rows of capacity (kernels.live_simdgroups,
      # timed at 32K and 128K only, SM clock at base): the kernel tests on the GPU, then GPU time a step with the clocks
      # left alone (the copy ceiling is measured at them too): 4K wide against default, 32K, 128K default against narrow
    run tests_cuda 200 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider -o addopts= \
      tests/kernels/test_attention_kernels.py -k "live"
    tail -3 "$W/tests_cuda.txt"
    K=lily_mlx.ops.attention.kernels
    sgt() { local name=$1 need=$2; shift 2; run "sgt_$name" "$need" python -m bench.step_gpu_time --compare lily \
      --clock-control none --cache-control none --out "$W/sgt_$name" "$@"; }
    sgt default_4k 90 --context 4096
    sgt wide_4k 80 --context 4096 --set $K.LIVE_WIDE_MIN_CAPACITY=0
    sgt default_128k 110 --context 131072
    sgt narrow_128k 100 --context 131072 --set $K.LIVE_WIDE_MIN_CAPACITY=1000000000
    sgt default_32k 80 --context 32768
    for f in "$W"/sgt_*/step_gpu_time.md; do echo "$f"; grep -E "partials|merge|attention kernels" "$f" | head -3; done
    rm -f "$W"/sgt_*/*.csv
    ;;
  21) # issue 13's e2e rows left by PART=17: 64K, and stock MLX-LM on CUDA ops beside the fair baseline (decode only:
      # its prefill of these lengths takes minutes), with the wide threadgroups of 2026-12-04
    run e2e_64k 400 python -m bench.run --mode e2e --size full \
      --engines lily,lily-off:gqa_packing,lily-off:fixed_block_attention,stock-kernels,stock --shared-prefill \
      --max-prefill-length "lily-off:gqa_packing=1K,lily-off:fixed_block_attention=1K,stock-kernels=1K,stock=1K" \
      --lengths 32K,64K,128K --rounds 1 --gen-tokens 256 --out "$W/e2e_64k" --stop-at $(( $(date +%s) + $(left) - 15 ))
    cat "$W/e2e_64k/e2e.md" 2>/dev/null
    ;;
  22) # the dense decode projections by lily's row GEMV (trial kernel linear_gemv) against MLX's qmv, which took 1.28 ms
      # of a 4.0 ms step at 4K on 2026-12-04 (the GEMV was 1.5-2.7x faster a projection on 2026-12-01, when the step
      # was host-bound); first the CUDA tests of the GEMV and of device_positions (its test mended after PART=19)
    run tests_cuda 150 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider -o addopts= \
      tests/kernels/test_compiled_decode.py tests/kernels/test_linear_kernels.py -k "device_positions or gemv"
    tail -3 "$W/tests_cuda.txt"
    run sgt_gemv 200 python -m bench.step_gpu_time --compare lily,lily-trial:linear_gemv --clock-control none \
      --cache-control none --out "$W/sgt_gemv"
    grep -E "^\| lily|qmv|gemv" "$W/sgt_gemv/step_gpu_time.md" 2>/dev/null | head -8
    rm -f "$W"/sgt_*/*.csv
    run decode_ab 150 python -m bench.decode_ab --engines lily,lily-trial:linear_gemv,stock-kernels --context 4096 \
      --bursts 8 --out "$W/decode_ab"
    tail -8 "$W/decode_ab.txt"
    ;;
  23) # constant_weights (a decoder layer's weights as its traces' constants: MLX no longer flattens ~45 arrays a
      # trace call; 1.08-1.18x faster graph build on the development CPU). It must be on when the model is patched, so
      # the whole part runs with LILY_ENABLE=constant_weights; lily-off:constant_weights is the same process's off state
    export LILY_ENABLE=constant_weights
    run tests_cuda 150 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider -o addopts= \
      tests/kernels/test_compiled_decode.py
    tail -3 "$W/tests_cuda.txt"
    run decode_ab 200 python -m bench.decode_ab --engines lily,lily-off:constant_weights,stock-kernels --context 4096 \
      --bursts 10 --out "$W/decode_ab"
    tail -8 "$W/decode_ab.txt"
    run decode_profile 200 python -m bench.run --mode decode-profile --size full --context 4096 --rounds 2 \
      --engines lily,lily-off:constant_weights --out "$W/dprof"
    head -8 "$W/dprof/decode_profile.md" 2>/dev/null
    ;;
  24) # step_trace (a one-token decode step of the whole model replays one trace; 1.5x faster graph build on the
      # development CPU) with constant_weights: first the CUDA tests of the traced steps (step_trace's own, the mended
      # device_positions test) and of the row GEMV (PART=22's); then decode in alternating bursts with both switches on
      # at patch time (LILY_ENABLE) and turned off per engine: lily-off:step_trace+constant_weights is today's default
      # (no stock engine here: switching to one unpatches the model, which drops every trace at each burst)
    run tests_cuda 300 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider -o addopts= \
      tests/kernels/test_compiled_decode.py tests/kernels/test_linear_kernels.py
    grep -v "TMA\|cuTensorMap" "$W/tests_cuda.txt" | tail -4
    export LILY_ENABLE=constant_weights,step_trace
    run decode_ab 200 python -m bench.decode_ab --engines \
      lily,lily-off:step_trace,lily-off:step_trace+constant_weights --context 4096 --bursts 10 \
      --out "$W/decode_ab"
    tail -9 "$W/decode_ab.txt"
    ;;
  25) # step_trace's build and eval split (decode profile, 2 rounds) and e2e decode at 4K and 32K, the switches on at
      # patch time as in PART=24
    export LILY_ENABLE=constant_weights,step_trace
    run decode_profile 260 python -m bench.run --mode decode-profile --size full --context 4096 --rounds 2 \
      --engines lily,lily-off:step_trace,lily-off:step_trace+constant_weights --out "$W/dprof"
    head -9 "$W/dprof/decode_profile.md" 2>/dev/null
    run e2e 260 python -m bench.run --mode e2e --size full --engines lily,lily-off:step_trace+constant_weights \
      --shared-prefill --lengths 4K,32K --rounds 2 --gen-tokens 256 --out "$W/e2e"
    cat "$W/e2e/e2e.md" 2>/dev/null | head -12
    ;;
  26) # issue 13's gqa_packing at 32K (1.109x end to end over two rounds on 2026-12-04, 1.381 before the live kernel's
      # 8-simdgroup threadgroups on CUDA): the attention kernels' GPU time a step at 32K packed and unpacked, the clocks
      # and caches left alone, to see which form moved
    run sgt_gqa 400 python -m bench.step_gpu_time --compare lily,lily-off:gqa_packing --context 32768 \
      --clock-control none --cache-control none --out "$W/sgt_gqa"
    grep -E "^\| lily|attention_decode" "$W/sgt_gqa/step_gpu_time.md" 2>/dev/null | head -8
    rm -f "$W"/sgt_gqa/*.csv
    ;;
  27) # issue 14's 8,000 tok/s at 4K: lily prefilling in chunks of 4,096 tokens against MLX-LM's 2,048, alternating in
      # one process, with the fair baseline's peak memory beside them (2026-12-04: 6,963 / 7,337 tok/s at 4K / 16K
      # with 4,096, one engine a process, no baseline on that machine)
    run e2e_chunks 480 python -m bench.run --mode e2e --size full --engines stock-kernels,lily,lily@chunk-4096 \
      --lengths 4K,8K,16K,32K --rounds 2 --long-from 32K --long-rounds 1 --prefill-only --out "$W/e2e_chunks" \
      --stop-at $(( $(date +%s) + $(left) - 15 ))
    cat "$W/e2e_chunks/e2e.md" 2>/dev/null | head -24
    ;;
  28) # issue 13's kernel rate (>= 70 % of copy at 32K-128K): the G = 8 heads as a matrix tile's rows, one simdgroup a
      # block (kernels.decode_attention_tiles_live), against the live form the product runs, kernel time only
    run live_check 150 python -m lily_dev.live_check --contexts 4096,32768,131072 --rounds 12
    tail -23 "$W/live_check.txt" 2>/dev/null
    run tests_cuda 300 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider \
      -o addopts= tests/kernels/test_attention_kernels.py -k "matrix_tile or live_length"
    tail -3 "$W/tests_cuda.txt" 2>/dev/null
    ;;
  29) # issue 12's expert GEMVs at >= 80 % of copy: gate+up at one token is 6.5x its byte time in a 32K step (17.6 us a
      # layer for ~10.6 MB), its 9,216 chains of 2,048 dependent FMAs the bound (docs/moe.md); the K-split candidate
      # (R, KC, SK) runs 4x the chains of a quarter the length. Kernel time only (the GEMM tiles keep SK = 1's bits).
    run op_cases 300 python -m bench.run --mode kernels --op-cases on \
      --op-match 'gemv_gate_up_swiglu_(staged|r[0-9]+_kc[0-9]+(_sk[0-9]+)?)_x8\[1tok\]' --out "$W/gemv_split"
    grep -E "gemv_gate_up" "$W/gemv_split/kernels.md" 2>/dev/null | head -12
    # what prefill would pay: the register tiles with the split's arithmetic (gate_up rows "K split 2 / 4")
    run gemm_split 150 python -m bench.gemm_tiles --variants --tokens 2048,8192 --out "$W/gemm_split.md"
    grep -E "gate_up register, 64 threads" "$W/gemm_split.md" 2>/dev/null
    run tests_cuda 150 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider \
      -o addopts= tests/kernels/test_moe_kernels.py -k "k_split or same_bits_as_gemm_tiles"
    tail -3 "$W/tests_cuda.txt" 2>/dev/null
    ;;
  30) # switch split_k_gate_up (off, a candidate: docs/moe.md): gate+up's sums as 4 K ranges in the product's routed
      # decode GEMV and the register tiles alike. It is on in the whole part; lily-off:split_k_gate_up is the same
      # process's off state. What decode gains (the routed GEMV: 706 us of a 32K step's GPU time, 6.5x its byte time)
      # and what prefill pays (the 64-thread register tiles keep running totals: 168 -> 250 registers).
    export LILY_ENABLE=split_k_gate_up
    run tests_cuda 150 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider -o addopts= \
      tests/kernels/test_moe_kernels.py -k "split_k_gate_up or k_split or same_bits_as_gemm_tiles"
    tail -3 "$W/tests_cuda.txt" 2>/dev/null
    run decode_ab 200 python -m bench.decode_ab --engines lily,lily-off:split_k_gate_up --context 4096 --bursts 10 \
      --out "$W/decode_ab"
    tail -8 "$W/decode_ab.txt" 2>/dev/null
    run e2e_split 200 python -m bench.run --mode e2e --size full --engines lily,lily-off:split_k_gate_up \
      --lengths 4K,32K --rounds 1 --out "$W/e2e_split" --stop-at $(( $(date +%s) + $(left) - 15 ))
    cat "$W/e2e_split/e2e.md" 2>/dev/null | head -16
    ;;
  31) # MLX-LM's --kv-bits: decode over a quantized KV cache in lily's kernels (op attention_decode_quantized; on CUDA
      # by default since 2026-12-05, the row written in the layer's trace with kv_write_in_trace: docs/attention.md,
      # "Quantized KV caches"): its CUDA tests, decode at 32K over a 4-bit cache (stock's quantized attention raises on
      # MLX's CUDA backend at this shape, so no stock engine) and over the plain cache, one process each; then the
      # kernels against stock's quantized attention, 8 calls an evaluation (timed on 2026-12-05: last)
    run tests_cuda 200 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider -o addopts= \
      tests/kernels/test_attention_quantized_kv.py
    tail -3 "$W/tests_cuda.txt" 2>/dev/null
    run decode_kv4 150 python -m bench.decode_ab --engines lily --context 32768 --kv-bits 4 --bursts 6 \
      --out "$W/decode_kv4"
    tail -4 "$W/decode_kv4.txt" 2>/dev/null
    run decode_plain 120 python -m bench.decode_ab --engines lily --context 32768 --bursts 6 --out "$W/decode_plain"
    tail -4 "$W/decode_plain.txt" 2>/dev/null
    run op_cases 150 python -m bench.run --mode kernels --op-cases on --op-match 'attention_quantized_' \
      --out "$W/quantized_kv"
    grep -E "attention_quantized" "$W/quantized_kv/kernels.md" 2>/dev/null | head -26
    ;;
  32) # the merge's one MW (8 at every context since 2026-12-05: no compile at a new capacity): the live form's kernel
      # time against MW = 32 (what contexts from 4K took before) and with twice the rows a block; then e2e decode at
      # 4K / 32K, two rounds, whose round-1 rates must now match round 2's (the first engine at a new length compiled
      # a merge before)
    run live_check 150 python -m lily_dev.live_check --contexts 4096,32768,131072 --rounds 12
    grep -E "live|stock" "$W/live_check.txt" 2>/dev/null | head -9
    run e2e_mw 300 python -m bench.run --mode e2e --size full --engines stock-kernels,lily --lengths 4K,32K --rounds 2 \
      --out "$W/e2e_mw" --stop-at $(( $(date +%s) + $(left) - 15 ))
    grep -E "\[e2e\] +(4K|32K) round" "$W/e2e_mw.txt" 2>/dev/null
    cat "$W/e2e_mw/e2e.md" 2>/dev/null | head -6
    ;;
  33) # switch long_live_blocks was removed after this part's A/B (off 1.02-1.05x faster at 32K and 128K on the H200,
      # 2026-12-05: docs/results/2026-12-05-h200-server-batch/)
    echo "part 33: switch long_live_blocks was removed on 2026-12-05 (docs/attention.md)"
    ;;
  34) # issue 12's expert GEMVs at ~13 % of copy, and not bound by their K chains (PART=30, 2026-12-05): gate+up and
      # down in K chunks of 512 (half the chunks a chain, twice the bytes in flight a chunk) and gate+up's direct
      # layout (each chain's row read by its thread, 4 or 8 groups a register batch, no barrier a chunk) against the
      # product's staged layouts (op cases, the same bits); then a 4K decode step's GPU time by kernel with the
      # product's routed gate+up at GEMV_LAYOUT's (16, 512), and with the down+combine's direct layout
      # (docs/results/2026-12-05-h100-gemv-layouts/)
    run op_cases 150 python -m bench.run --mode kernels --op-cases on \
      --op-match 'gemv_(gate_up_swiglu|down)_(staged|r16_kc512|r32_kc512|direct_r16_kb[48])_x8\[1tok\]' \
      --out "$W/gemv_layouts"
    grep -E "gemv_" "$W/gemv_layouts/kernels.md" 2>/dev/null | head -10
    K=lily_mlx.ops.moe.kernels
    sgt() { local name=$1 need=$2; shift 2; run "sgt_$name" "$need" python -m bench.step_gpu_time --compare lily \
      --context 4096 --out "$W/sgt_$name" "$@"; }
    sgt staged 100
    sgt kc512 100 --set "$K.GEMV_LAYOUT={'gate_up': (16, 512), 'down': (32, 256)}"
    export LILY_ENABLE=direct_down_combine
    sgt direct 100  # (on 2026-12-05 also with the routed gate+up read row by row: 41 % slower, removed)
    unset LILY_ENABLE
    for f in "$W"/sgt_*/step_gpu_time.md; do echo "$f"; grep -E "^\| lily|gate_up|down_combine" "$f" | head -4; done
    rm -f "$W"/sgt_*/*.csv
    ;;
  35) # why the expert GEMVs sit at ~13 % of copy: Nsight Compute's sections and stall samples by instruction of the
      # product's routed gate+up GEMV (one token) and its down GEMV with the combine in a 4K decode step
      # (bench.kernel_sections, two ncu runs each)
    run ks_gate_up 200 python -m bench.kernel_sections --kernel gemv_gate_up_swiglu_routed --context 4096 \
      --out "$W/ks_gate_up"
    cat "$W/ks_gate_up/sections.md" 2>/dev/null | head -40
    run ks_down 200 python -m bench.kernel_sections --kernel gemv_down_combine --context 4096 --out "$W/ks_down"
    cat "$W/ks_down/sections.md" 2>/dev/null | head -40
    rm -f "$W"/ks_*/source.csv
    ;;
  36) # switch direct_down_combine (off, a candidate: the down+combine kernel's direct layout, 25 % less GPU time in a
      # 4K step on the H100, 7 % on the H200; the same bits): decode in alternating bursts on against off in one
      # process at 4K and 32K, then its CUDA tests
    switch_ab ab_4k 150 direct_down_combine 4096 10
    switch_ab ab_32k 170 direct_down_combine 32768 10
    run tests_cuda 150 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider -o addopts= \
      tests/kernels/test_moe_kernels.py -k "down_combine or down_gemv_with"
    tail -3 "$W/tests_cuda.txt" 2>/dev/null
    ;;
  37) # op attention_decode_batch (the fixed-block split over a server batch's rows, each row's blocks from its own
      # left padding and of its own length's size; a trial kernel on GPUs): its CUDA tests, then kernel time against
      # stock's attention with the batch's mask and the one-pass kernel, 4 rows of S, S / 2, S / 4, S / 8 keys
      # (attention_batch_* op cases, 8 calls an evaluation; with the schedule's candidates). SKIP_TESTS=1: the op cases
      # alone (the tests passed on an H100 on 2026-12-05 and compile ~30 kernels on a fresh machine: ~4 minutes)
    if [ -z "${SKIP_TESTS:-}" ]; then
      run tests_cuda 150 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider \
        -o addopts= tests/kernels/test_attention_kernels.py -k "batch or row_blocks"
      tail -3 "$W/tests_cuda.txt" 2>/dev/null
    fi
    run op_cases 200 python -m bench.run --mode kernels --op-cases on --op-match 'attention_batch_' --out "$W/batch"
    grep -E "attention_batch" "$W/batch/kernels.md" 2>/dev/null | head -26
    ;;
  38) # a server's batch decoded end to end (bench.decode_ab --batch-contexts: rows prefilled alone, merged into
      # MLX-LM's batch caches as BatchGenerator merges them, one token a row a step): lily (attention_decode_batch on
      # CUDA since 2026-12-05) against lily with stock's masked attention (lily-off:fixed_block_attention) and the fair
      # baseline, at rows of 32K / 16K / 8K / 4K and of 8K / 4K / 2K / 1K tokens
    run batch_long 270 python -m bench.decode_ab --engines lily,lily-off:fixed_block_attention,stock-kernels \
      --batch-contexts 32768,16384,8192,4096 --bursts 6 --out "$W/batch_long"
    tail -7 "$W/batch_long.txt" 2>/dev/null
    run batch_short 200 python -m bench.decode_ab --engines lily,lily-off:fixed_block_attention,stock-kernels \
      --batch-contexts 8192,4096,2048,1024 --bursts 6 --out "$W/batch_short"
    tail -7 "$W/batch_short.txt" 2>/dev/null
    ;;
  39) # the down+combine's schedule in a 4K step (GPU time by kernel, clocks and caches as the run leaves them): with
      # its ring (down_combine_ring, on: 4 chunks in flight) against one chunk in flight in the same process; with the
      # groups' simdgroup barriers (down_combine_simd_barriers, a candidate: Nsight Compute put 46 % of the kernel's
      # stall samples at its per-chunk threadgroup barrier, H100 2026-12-05). First the down+combine's CUDA tests (the
      # same bits in every state)
    run tests_cuda 150 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider -o addopts= \
      tests/kernels/test_moe_kernels.py -k "down_gemv_with or down_combine"
    tail -3 "$W/tests_cuda.txt" 2>/dev/null
    run sgt_ring 160 python -m bench.step_gpu_time --compare lily,lily-off:down_combine_ring \
      --clock-control none --cache-control none --out "$W/sgt_ring"
    grep -E "^\| lily|down_combine" "$W/sgt_ring/step_gpu_time.md" 2>/dev/null | head -8
    run sgt_simd 160 env LILY_ENABLE=down_combine_simd_barriers python -m bench.step_gpu_time \
      --compare lily,lily-off:down_combine_simd_barriers --clock-control none --cache-control none --out "$W/sgt_simd"
    grep -E "^\| lily|down_combine" "$W/sgt_simd/step_gpu_time.md" 2>/dev/null | head -8
    rm -f "$W"/sgt_*/*.csv
    ;;
  40) # the down+combine with 8 chunks in flight (162 registers) and with 8 output columns a threadgroup (256
      # threadgroups of 12 groups instead of 128 of 10; chunks of 128), a 4K step's GPU time by kernel; then
      # down_combine_ring end to end: decode in alternating bursts on / off in one process at 4K and 32K (it became
      # the default on its kernel time: 18-24 % less in a 4K step, H100 2026-12-05)
    down_combine_forms
    switch_ab ab_ring_4k 150 down_combine_ring 4096 10
    switch_ab ab_ring_32k 170 down_combine_ring 32768 10
    ;;
  41) # down_combine_simd_barriers (on by default since 2026-12-05: 18 % less kernel time in a 4K step): decode in
      # bursts on / off at 4K, then Nsight Compute's sections and stall samples of the down+combine with it
    switch_ab ab_simd_4k 150 down_combine_simd_barriers 4096 10
    run ks_down_simd 200 env LILY_ENABLE=down_combine_simd_barriers python -m bench.kernel_sections \
      --kernel gemv_down_combine --context 4096 --out "$W/ks_down_simd"
    cat "$W/ks_down_simd/sections.md" 2>/dev/null | head -30
    rm -f "$W"/ks_*/source.csv
    ;;
  42) # a server batch's step build on this host (bench.decode_graph, no GPU work: is a batch's decode host-bound?),
      # then the batch split's schedule candidates at batches of 1, 2, 4 and 8 rows (attention_batch_* op cases; the
      # aim is a constant of the schedule, never keyed on the batch, so it has to serve every batch size)
    run graph_batch 60 python -m bench.decode_graph --layers 40 --batch-contexts 40,20,10,5
    tail -6 "$W/graph_batch.txt" 2>/dev/null
    run graph_single 60 python -m bench.decode_graph --layers 40
    tail -6 "$W/graph_single.txt" 2>/dev/null
    run op_cases 300 python -m bench.run --mode kernels --op-cases on --op-match 'attention_batch_' --out "$W/batch"
    grep -E "attention_batch" "$W/batch/kernels.md" 2>/dev/null | head -100
    ;;
  43) # the routed gate+up GEMV with chunks in flight (GATE_UP_IN_FLIGHT, moe_gemv_staged_ring; the same bits), a 4K
      # step's GPU time by kernel: 2 in flight at the product's chunks of 256 (218 registers), 4 at chunks of 128 (162)
      # and 8 at chunks of 64 (164); the product took 18.2 us a layer (H100, 2026-12-05). First their CUDA tests (the
      # staged schedule's bits)
    run tests_cuda 120 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider -o addopts= \
      tests/kernels/test_moe_kernels.py -k "gate_up_gemv_with_chunks_in_flight"
    tail -3 "$W/tests_cuda.txt" 2>/dev/null
    run sgt_gu2 100 python -m bench.step_gpu_time --compare lily --set lily_mlx.ops.moe.kernels.GATE_UP_IN_FLIGHT=2 \
      --clock-control none --cache-control none --out "$W/sgt_gu2"
    grep -E "^\| lily|gate_up" "$W/sgt_gu2/step_gpu_time.md" 2>/dev/null | head -4
    run sgt_gu4 100 python -m bench.step_gpu_time --compare lily --set lily_mlx.ops.moe.kernels.GATE_UP_IN_FLIGHT=4 \
      --set "lily_mlx.ops.moe.kernels.GEMV_LAYOUT={'gate_up': (16, 128), 'down': (32, 256)}" \
      --clock-control none --cache-control none --out "$W/sgt_gu4"
    grep -E "^\| lily|gate_up" "$W/sgt_gu4/step_gpu_time.md" 2>/dev/null | head -4
    run sgt_gu8 100 python -m bench.step_gpu_time --compare lily --set lily_mlx.ops.moe.kernels.GATE_UP_IN_FLIGHT=8 \
      --set "lily_mlx.ops.moe.kernels.GEMV_LAYOUT={'gate_up': (16, 64), 'down': (32, 256)}" \
      --clock-control none --cache-control none --out "$W/sgt_gu8"
    grep -E "^\| lily|gate_up" "$W/sgt_gu8/step_gpu_time.md" 2>/dev/null | head -4
    rm -f "$W"/sgt_*/*.csv
    ;;
  44) # the dense row GEMV (trial kernel linear_gemv) with each decoder layer's input RMSNorm inside the GEMV of the
      # projection after it (switch gemv_input_norm; its first build, H100 2026-12-05: 17.5 us a launch, no faster than
      # the norm's own launch plus the plain GEMV; now the weights' loads go out before the norm's sum of squares) and
      # a DeltaNet layer's in-projection inside its step's kernel (switch fused_in_proj_step, deltanet_decode_from_hidden:
      # 32 threadgroups read the 12 MB in-projection) and an attention layer's q/k/v projection inside its q/k
      # preparation (fused_qkv_prep, attention_qk_prep_from_hidden: 36 threadgroups read 9 MB): CUDA tests, then a 4K
      # step's GPU time by kernel for lily, the trial with all, without the two folds, without all three (H100,
      # 2026-12-05: 3.818 / 4.018 / 3.708 / 3.513 ms; the DeltaNet fold and the norm inside slower, the q/k/v fold faster)
    run tests_cuda 270 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider -o addopts= \
      tests/kernels/test_linear_kernels.py tests/kernels/test_deltanet_from_hidden.py \
      tests/kernels/test_attention_qkv_prep.py
    tail -3 "$W/tests_cuda.txt"
    run sgt_gemv_norm 300 env LILY_ENABLE=$FOLD_SWITCHES python -m bench.step_gpu_time --compare "lily,$GEMV_ENGINES" \
      --clock-control none \
      --cache-control none --out "$W/sgt_gemv_norm"
    grep -E "^\| lily|qmv|gemv|rms_norm|deltanet_decode|qk_prep" "$W/sgt_gemv_norm/step_gpu_time.md" 2>/dev/null | head -28
    # the DeltaNet fold with both of a lane's weight pieces a row in flight (127 registers of the 128 allowed)
    run sgt_fold_u2 120 env LILY_ENABLE=$FOLD_SWITCHES python -m bench.step_gpu_time --compare lily-trial:linear_gemv \
      --set lily_mlx.ops.deltanet.kernels.FROM_HIDDEN_UNROLL=2 --clock-control none --cache-control none \
      --out "$W/sgt_fold_u2"
    grep -E "^\| lily|deltanet_decode" "$W/sgt_fold_u2/step_gpu_time.md" 2>/dev/null | head -4
    rm -f "$W"/sgt_*/*.csv
    ;;
  45) # PART=44's engines end to end: decode in alternating bursts at 4K (lily, the trial row GEMV with the input norm
      # and the DeltaNet in-projection inside, without the latter, without both), then the decode profile (primitives,
      # build and eval a step) of lily and the trial with both
    run decode_ab 260 env LILY_ENABLE=$FOLD_SWITCHES python -m bench.decode_ab --engines "lily,$GEMV_ENGINES" \
      --context 4096 --bursts 8 \
      --out "$W/decode_ab"
    tail -9 "$W/decode_ab.txt"
    run profile 200 env LILY_ENABLE=$FOLD_SWITCHES python -m bench.run --mode decode-profile \
      --engines lily,lily-trial:linear_gemv --context 4096 \
      --out "$W/profile"
    tail -8 "$W/profile.txt"
    ;;
  46) # the trial row GEMV in its defaults since PART=44 (the q/k/v fold on, the norm inside and the DeltaNet fold off)
      # end to end: decode in alternating bursts at 4K against lily and against the trial without the q/k/v fold, then
      # the decode profile of lily and the trial (H100, 2026-12-05, a fast host: 1.015x / 1.003x lily, 301 tok/s each
      # pipelined in the profile)
    run decode_ab 260 python -m bench.decode_ab --engines lily,lily-trial:linear_gemv,lily-trial:linear_gemv@off-fused_qkv_prep \
      --context 4096 --bursts 8 --out "$W/decode_ab"
    tail -9 "$W/decode_ab.txt"
    run profile 200 python -m bench.run --mode decode-profile --engines lily,lily-trial:linear_gemv --context 4096 \
      --out "$W/profile"
    tail -8 "$W/profile.txt"
    ;;
  47) # fused_output_gate (off: 1.008x slower on a slow host, H200 2026-12-04) in bursts at 4K and 32K, now that a fast
      # host's pipelined step is bound by the launches' issue (docs/results/2026-12-05-h100-folds-timed/: 10 launches
      # and 20 primitives fewer a step with it); then PART=40's two step-time candidates of the down+combine
    switch_ab ab_gate_4k 150 fused_output_gate 4096 10
    switch_ab ab_gate_32k 170 fused_output_gate 32768 10
    down_combine_forms
    ;;
  48) # what a launch costs this host at build and at evaluation, lily's against MLX's own (the trial GEMV's 0.3-0.4 ms
      # less GPU time did not reach pipelined decode on a fast host: docs/results/2026-12-05-h100-folds-timed/); then
      # issue 13's gqa_packing on / off at 32K in alternating bursts (1.109x and 1.381x in two runs on 2026-12-04; the
      # attention kernels' GPU time bounds it near 1.075x: docs/attention.md). Ran on an H100 on 2026-12-06: level end
      # to end in both engine orders, the same engine against itself 0.992-1.012
      # (docs/results/2026-12-06-h100-gqa-packing-launch-cost/)
    run launch_cost 150 python -m bench.launch_cost
    tail -14 "$W/launch_cost.txt" 2>/dev/null
    run ab_gqa_32k 240 python -m bench.decode_ab --engines lily,lily-off:gqa_packing --context 32768 --bursts 10 \
      --out "$W/ab_gqa_32k"
    tail -8 "$W/ab_gqa_32k.txt" 2>/dev/null
    ;;
  *) echo "PART must be 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47 or 48" \
       >&2
     exit 2 ;;
esac
say "part ${PART:-1} done"
