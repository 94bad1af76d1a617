"""The router's logits at Qwen3.6's shape (256 experts + the shared-expert gate, hidden 2048, 8-bit router,
bf16) for a prompt chunk, one token a threadgroup (``moe_router_logits_q``) against G tokens a threadgroup
(``moe_router_logits_tokens_q``, the same bits). Medians of evaluated calls on this backend, as a Markdown
table of microseconds.

    python -m bench.router_groups [--tokens 512,2048] [--groups 1,8,16] [--out router.md]
"""

from __future__ import annotations

import argparse
from typing import List

import mlx.core as mx

from bench.gemm_tiles import median_us, print_table
from lily_dev.moe_testing import make_inputs, make_sparse_moe_block
from lily_mlx.core.dispatch import op_backend
from lily_mlx.ops.moe import kernels as mk


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.router_groups", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--groups", default="1,8,16", help="tokens a threadgroup (1: moe_router_logits_q)")
    ap.add_argument("--out", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    backend = op_backend("moe_router")
    block = make_sparse_moe_block(hidden=2048, expert_width=64, num_experts=256, top_k=8, seed=0,
                                  shared_width=64)
    groups = [int(g) for g in args.groups.split(",")]
    lines = [f"Router logits (256 experts + gate, hidden 2048, 8-bit), backend {backend}: us, medians of 15 calls",
             "", "| tokens | " + " | ".join(f"{g} a threadgroup" for g in groups) + " |",
             "|---|" + "---|" * len(groups)]
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = make_inputs(1, tokens, 2048, seed=tokens).reshape(tokens, 2048)
        mx.eval(x)
        want = mk.router_logits(block, x, True, backend, tokens_per_group=1)
        cells = []
        for g in groups:
            got = mk.router_logits(block, x, True, backend, tokens_per_group=g)
            same = mx.array_equal(got, want).item()
            us = median_us(lambda: mk.router_logits(block, x, True, backend, tokens_per_group=g))
            cells.append(f"{us:,.0f}" + ("" if same else " (NOT the same bits)"))
        lines.append(f"| {tokens} | " + " | ".join(cells) + " |")
    print_table(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
