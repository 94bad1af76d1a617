"""Decode attention microbenchmarks at Qwen3.6's full-attention shape, for the bench harness.

``microbench_cases()`` -> [(name, run_once, bytes_moved, flops)] at each context: stock's
``mx.fast.scaled_dot_product_attention`` (what stock MLX-LM runs for a decode row), lily's one-pass
decode kernel (``gqa_packing`` on and off) and the fixed-block split (block partials + merge) at
4096-row blocks and at smaller ones (the block size is a tuning knob). Bytes: the live K and V rows
once (the floor), plus q and out; flops: 4 * Hq * S * D (two products per row and head).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx

from lily_mlx.core.backend import resolve_backend
from lily_mlx.ops.attention import kernels as ak

# Qwen3.6-35B-A3B full attention (one rank): 16 query heads over 2 KV heads, head dim 256.
QWEN36 = dict(Hq=16, Hkv=2, D=256)
CONTEXTS = (4096, 32768, 65536, 131072)
BLOCK_ROWS = (ak.FIXED_BLOCK_SIZE, 1024)

Case = Tuple[str, Callable[[], None], int, int]


def microbench_cases(backend: Optional[str] = None, contexts: Sequence[int] = CONTEXTS, B: int = 1,
                     dtype=mx.bfloat16) -> List[Case]:
    backend = backend or resolve_backend()
    Hq, Hkv, D = QWEN36["Hq"], QWEN36["Hkv"], QWEN36["D"]
    isz = mx.zeros((), dtype=dtype).itemsize
    scale = D ** -0.5
    cases: List[Case] = []
    for S in contexts:
        key = mx.random.key(S)
        kq, kk, kv = mx.random.split(key, 3)
        q = mx.random.normal((B, Hq, 1, D), key=kq).astype(dtype)
        k = mx.random.normal((B, Hkv, S, D), key=kk).astype(dtype)
        v = mx.random.normal((B, Hkv, S, D), key=kv).astype(dtype)
        mx.eval(q, k, v)
        nbytes = (2 * B * Hkv * S * D + 2 * B * Hq * D) * isz
        flops = 4 * B * Hq * S * D
        label = f"{S // 1024}K" if S % 1024 == 0 else str(S)

        def stock(q=q, k=k, v=v):
            mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale))

        cases.append((f"attention_stock_sdpa_S{label}", stock, nbytes, flops))
        if backend == "reference":
            continue
        for packed in (True, False):
            def one_pass(q=q, k=k, v=v, packed=packed):
                mx.eval(ak.decode_attention(q, k, v, scale=scale, gqa_packed=packed, backend=backend))

            name = f"attention_decode_{'gqa' if packed else 'per_head'}_S{label}"
            cases.append((name, one_pass, nbytes, flops))
        for rows in BLOCK_ROWS:
            def blocks(q=q, k=k, v=v, rows=rows):
                mx.eval(ak.decode_attention_fixed_blocks(q, k, v, scale=scale, block_rows=rows, backend=backend))

            cases.append((f"attention_fixed_blocks_{rows}_S{label}", blocks, nbytes, flops))
    return cases
