"""Is a row's result independent of the other rows of its call, on this machine's backend?

    LILY_BACKEND=cuda python -m bench.batch_invariance

Checks, on the default device, the pieces one MoE layer is made of, each with 16 tokens in one call
against each token alone (max |difference|, 0 = bitwise equal):

- stock's ops the MoE layer keeps: the 8-bit router projection and the 4-bit shared expert
  (MLX's quantized matmul);
- lily's routed-expert kernels with the routing held fixed (same experts and weights for a token
  alone and in the batch), in every MoE switch state.

On the CPU backend every line is 0 (tests/kernels/test_batch_invariance.py asserts it in CI).
"""

from __future__ import annotations

import mlx.core as mx

from lily_dev.moe_testing import make_inputs, make_sparse_moe_block
from lily_mlx.core import dispatch, switches
from lily_mlx.ops.moe import kernels as mk
from lily_mlx.ops.moe.reference import router_reference, shared_expert_reference

MOE_SWITCHES = ("fused_dequant", "gpu_routing", "adaptive_tile", "fused_combine")


def _max_diff(batch: mx.array, alone: list) -> float:
    ref = mx.concatenate(alone, axis=0)
    return float(mx.max(mx.abs(batch.astype(mx.float32) - ref.astype(mx.float32))).item())


def main() -> int:
    backend = dispatch.resolve()
    block = make_sparse_moe_block(hidden=2048, expert_width=512, num_experts=256, top_k=8, seed=3, skew=3.0)
    x = make_inputs(16, 1, 2048, seed=7, mean=0.3)  # 16 decode rows, [16, 1, D]
    rows = [x[t:t + 1] for t in range(16)]
    print(f"backend {backend}, device {mx.default_device()}")
    print(f"router logits (stock 8-bit qmm): {_max_diff(block.gate(x), [block.gate(r) for r in rows]):.3g}")
    print(f"shared expert (stock 4-bit qmm): "
          f"{_max_diff(shared_expert_reference(block, x), [shared_expert_reference(block, r) for r in rows]):.3g}")
    inds, scores = router_reference(block.gate(x), 8, True)  # one routing for both sides
    for off in [()] + [(n,) for n in MOE_SWITCHES]:
        with switches.overrides(disable=off):
            batch = mk.routed_experts_combined_kernel(block.switch_mlp, x, inds, scores)
            alone = [mk.routed_experts_combined_kernel(block.switch_mlp, x[t:t + 1], inds[t:t + 1],
                                                       scores[t:t + 1]) for t in range(16)]
            big = mk.routed_experts_combined_kernel(  # 128 tokens: routed schedule, 32-row tiles
                block.switch_mlp, mx.concatenate([x] * 8), mx.concatenate([inds] * 8), mx.concatenate([scores] * 8))
            print(f"lily routed experts {'all-on' if not off else off[0] + '-off'}: 16 rows vs alone "
                  f"{_max_diff(batch, alone):.3g}; in 128 rows vs alone {_max_diff(big[:16], alone):.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
