"""How far stock's router logits are from the fp32 value, and how often lily's router picks other experts.

    LILY_BACKEND=sim python -m bench.router_rounding [--model M] [--tokens 200] [--layer 0]

On one MoE layer of the model (default: the embedded model), for random bf16 activations: stock's
router logits (``block.gate(x)``, the quantised matmul of this backend) against ``x @ W^T`` in fp32 on
the same dequantised weights, rounded to bf16 (fraction that differ, largest difference); and the
tokens whose top-k expert set differs between stock's router ops and lily's router kernel (the
active kernel backend). Explains the consistency figures of docs/moe.md.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.router_rounding", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import mlx_lm

    from lily_mlx.core.dispatch import op_backend
    from lily_mlx.models.embedded import EMBEDDED_DIR
    from lily_mlx.ops.moe import kernels as mk
    from lily_mlx.ops.moe.reference import router_reference

    model, _ = mlx_lm.load(str(args.model or EMBEDDED_DIR))
    block = model.layers[args.layer].mlp
    gate = block.gate
    x = mx.random.normal((args.tokens, gate.weight.shape[1] * 32 // gate.bits),
                         key=mx.random.key(args.seed)).astype(mx.bfloat16)
    stock = block.gate(x)
    w = mx.dequantize(gate.weight, gate.scales, gate.biases, group_size=gate.group_size, bits=gate.bits)
    exact = (x.astype(mx.float32) @ w.astype(mx.float32).T).astype(mx.bfloat16)
    differ = float((stock != exact).astype(mx.float32).mean().item())
    largest = float(mx.abs(stock.astype(mx.float32) - exact.astype(mx.float32)).max().item())
    print(f"layer {args.layer}: {args.tokens} tokens x {stock.shape[-1]} experts; stock's router logits differ from "
          f"the fp32 value (rounded to bf16) in {100 * differ:.1f} % of entries, by up to {largest:.4g}")

    backend = op_backend("moe_router")
    if backend == "reference":
        print("no router kernel on the reference backend: set LILY_BACKEND=sim (or metal/cuda) for the comparison")
        return 0
    stock_inds, _ = router_reference(stock, block.top_k, block.norm_topk_prob)
    lily_inds = mk.route_tokens(block, x, False, backend)[0]
    a, b = np.sort(np.asarray(stock_inds), -1), np.sort(np.asarray(lily_inds), -1)
    print(f"tokens whose top-{block.top_k} experts differ between stock's router and lily's kernel ({backend}): "
          f"{int((a != b).any(-1).sum())} of {args.tokens}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
