#!/usr/bin/env bash
# The register-tiled MoE GEMMs (switch register_tiles) on one NVIDIA GPU, in calls of under 10 minutes:
#
#   PART=1 bash bench/device_register_tiles.sh   # CUDA tests (same bits as the simdgroup tiles and the
#                                                # decode GEMVs), then the GEMM op cases, both tile forms
#   PART=2 bash bench/device_register_tiles.sh   # e2e prefill: stock-kernels, lily, lily-off:register_tiles
#   PART=3 bash bench/device_register_tiles.sh   # prefill sweep 512 .. 32K: stock (to 4K), stock-kernels, lily
#   PART=4 bash bench/device_register_tiles.sh   # GEMM variants timed, ncu's full sections of the register tiles
#   PART=5 bash bench/device_register_tiles.sh   # 64-thread register tiles: CUDA tests, GEMM variants, e2e
#                                                # prefill with tall_register_blocks on / off
#   PART=6 bash bench/device_register_tiles.sh   # prefill GPU time by kernel (a 2048-token chunk after 2048
#                                                # cached), ncu's memory sections of the register tiles
#   PART=7 bash bench/device_register_tiles.sh   # the router's logits of token groups: CUDA tests, e2e prefill
#                                                # 512 / 4K / 16K against the fair baseline
#   PART=8 bash bench/device_register_tiles.sh   # ncu's warp stall reasons of the register tiles; the router's
#                                                # token groups timed
#
# Results under $OUT/register_tiles (Markdown tables, JSON, logs).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}
W=$OUT/register_tiles
TAG=register_tiles
. bench/device_budget.sh
case "${PART:-1}" in
  1)
    run tests_cuda 120 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider \
      -o addopts= tests/kernels/test_moe_kernels.py \
      -k "register_tiles or decode_gemvs_same_bits or grouped_gemms or half_tiles"
    grep -v "TMA\|cuTensorMap" "$W/tests_cuda.txt" | tail -4
    run op_cases 120 python -c "
import json, sys
from bench import kernels
ceil = kernels.ceilings()
rows = kernels.op_cases(families=('moe',), ceil=ceil, match=r'gemm_.*fused_(adaptive|fixed16)(_regtiles)?\[|stock_switch_glu')
open('$W/op_cases.md', 'w').write(kernels.op_cases_markdown(rows) + '\n')
json.dump({'ceilings': ceil, 'rows': rows}, open('$W/op_cases.json', 'w'), indent=1)
"
    cat "$W/op_cases.md" 2>/dev/null
    ;;
  2)
    run e2e 300 python -m bench.run --mode e2e --size full --engines stock-kernels,lily,lily-off:register_tiles \
      --lengths 512,4K --rounds 2 --prefill-only --out "$W/e2e"
    cat "$W/e2e/e2e.md" 2>/dev/null
    ;;
  3)  # issue 14's sweep: prefill at 512 .. 32K, stock (up to 4K: ~290 tok/s on CUDA), the fair baseline, lily
    run sweep 400 python -m bench.run --mode e2e --size full --engines stock,stock-kernels,lily \
      --lengths 512,2K,4K,16K,32K --max-prefill-length stock=4K --rounds 2 --long-from 16K --long-rounds 1 \
      --prefill-only --out "$W/sweep"
    cat "$W/sweep/e2e.md" 2>/dev/null
    ;;
  4)  # why the register tiles reach ~35 % of the fp32 FMA rate: ncu's full sections of one launch of each at 2K
      # tokens, and down at 64 columns a threadgroup (TN = 4) against 128 (TN = 8)
    run gemm_variants 120 python -m bench.gemm_tiles --variants --out "$W/variants.md"
    cat "$W/variants.md" 2>/dev/null
    run ncu 200 ncu --set full -k regex:regtile -c 4 python -m bench.gemm_tiles --tokens 2048 --once
    grep -E "regtile|Duration|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Stall|Warp Cycles Per Issued|Executed Ipc|L1/TEX Hit|Bank" "$W/ncu.txt" | head -80
    ;;
  5)  # the 64-thread register tiles (tall_register_blocks): CUDA tests, GEMM variants, e2e prefill on / off
    run tests_cuda 100 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider \
      -o addopts= tests/kernels/test_moe_kernels.py -k "register_tiles_have or decode_gemvs_same_bits"
    grep -v "TMA\|cuTensorMap" "$W/tests_cuda.txt" | tail -2
    run gemm_variants 70 python -m bench.gemm_tiles --variants --out "$W/variants.md"
    cat "$W/variants.md" 2>/dev/null
    run e2e_tall 300 python -m bench.run --mode e2e --size full \
      --engines stock-kernels,lily,lily-off:tall_register_blocks --lengths 512,4K --rounds 2 --prefill-only \
      --out "$W/e2e_tall"
    cat "$W/e2e_tall/e2e.md" 2>/dev/null
    ;;
  6)  # where a prompt chunk's GPU time goes, kernel by kernel, lily against the fair baseline; ncu's memory
      # sections of the 128- and 64-thread register tiles
    run prefill_gpu_time 300 python -m bench.step_gpu_time --compare "${ENGINES:-lily,stock-kernels}" --context 2048 \
      --prefill-chunk 2048 --steps 1 --out "$W/prefill_sgt"
    head -40 "$W/prefill_sgt/step_gpu_time.md" 2>/dev/null
    rm -f "$W"/prefill_sgt/*.csv
    run ncu 150 ncu --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section Occupancy \
      --section LaunchStats --section ComputeWorkloadAnalysis -k regex:regtile -c 4 \
      python -m bench.gemm_tiles --tokens 2048 --once
    grep -E "regtile|Duration|Registers Per|Achieved Occupancy|L1/TEX Cache Throughput|Mem Busy|Issue Slots|Bank" \
      "$W/ncu.txt" | head -60
    ;;
  7)  # the router's logits of token groups (moe_router_logits_tokens_q): CUDA tests, e2e prefill 512 .. 16K
    run tests_cuda_router 90 env LILY_TEST_KERNEL_BACKEND=cuda CI=true python -m pytest -q -p no:cacheprovider \
      -o addopts= tests/kernels/test_moe_kernels.py -k "router_logits_of_token_groups or split_router or token_alone"
    grep -v "TMA\|cuTensorMap" "$W/tests_cuda_router.txt" | tail -2
    run e2e_router 330 python -m bench.run --mode e2e --size full --engines stock-kernels,lily \
      --lengths 512,4K,16K --rounds 2 --long-from 16K --long-rounds 1 --prefill-only --out "$W/e2e_router"
    cat "$W/e2e_router/e2e.md" 2>/dev/null
    ;;
  8)  # what stalls the register tiles (ncu's warp states and instruction mix at 2K tokens), then the router's
      # token groups timed (1, 8, 16 tokens a threadgroup)
    run ncu_stalls 60 ncu --section WarpStateStats --section InstructionStats --section LaunchStats \
      -k regex:regtile -c 4 python -m bench.gemm_tiles --tokens 2048 --once
    grep -E "regtile|Stall|Warp Cycles|Issued Ipc|Executed Instructions  " "$W/ncu_stalls.txt" | head -60
    run router_groups 40 python -m bench.router_groups --out "$W/router_groups.md"
    cat "$W/router_groups.md" 2>/dev/null
    ;;
  *) echo "PART must be 1, 2, 3, 4, 5, 6, 7 or 8" >&2; exit 2 ;;
esac
say "part ${PART:-1} done"
