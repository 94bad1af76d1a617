"""Attention of the Qwen3.5/3.6 full-attention layers (mlx_lm's ``Qwen3NextAttention``): the op
family. Importing it registers its ops in ``lily_mlx.core.dispatch`` and gives ``attention_forward``,
the forward the patch layer swaps in.

Modules: ``layer`` (the forward and the dispatch of each op), ``kernels`` (the attention kernels'
launchers and shape rules; kernels/attention/decode.metal and prefill.metal), ``reference`` (plain-MLX
references and the fixed-block algorithm).

Seven ops, each a function of ``layer`` with a reference in plain MLX ops and one dispatch point into
a kernel:

- ``qk_prep``: q_norm, k_norm, partial RoPE and the split of the output gate off ``q_proj``.
- ``prefill_attention``: a chunk of T > 1 queries over cache + chunk (causal or given mask).
- ``decode_attention``: one query row per sequence over the KV cache, GQA.
- ``quantized_decode_attention``: the same over a quantized KV cache (``--kv-bits``), dequantised in the kernel.
- ``qkv_proj``: the q/k/v projections of a decode-sized call as one quantised matmul (switch
  ``fused_qkv_proj``; ``lily_mlx.core.projections``).
- ``batch_decode_attention``: one query row for each row of a batch (``BatchKVCache``, the server's batches): the
  fixed-block split with each row's blocks of its own length, so a row's bits do not depend on the batch.
- ``long_context_attention``: decode at long context, where the write-up splits the KV cache into
  fixed blocks processed in parallel and merges them (``reference.blockwise_attention`` is that
  algorithm in plain MLX; the reference stays stock's primitive so the reference path is
  token-identical). Its kernels' live-length form serves every context where a decode step attends over
  the KV buffer (switch ``kv_write_in_trace``; ``fused_output_gate``: its merge applies the output gate).

Kernels: ``attention_decode``, ``attention_decode_long`` (the fixed-block split: block partials, then a merge),
``attention_decode_batch`` (the split over a batch's rows), ``attention_decode_quantized`` (both forms over a
quantized cache), ``attention_prefill`` (flash-attention tiles; kernels/attention/prefill.metal),
``attention_qk_prep`` (switch ``fused_qk_prep``; kernels/attention/qk_prep.metal).
"""

from __future__ import annotations

from ...core.dispatch import Op, register_op
from . import kernels

# Attention kernels not on by default for a GPU backend are trial kernels there: each runs on a machine
# whose tune profile measured it correct and faster than stock's attention (docs/usage.md, "Tuning").
GPU_BACKENDS = kernels.GPU_BACKENDS
from .layer import attention_forward  # noqa: F401

QK_PREP = register_op(Op(
    "attention_qk_prep", "attention",
    "q/k RMSNorm, partial RoPE and output-gate split of a full-attention layer",
    switches=("fused_qk_prep",),
    kernel_backends=kernels.QK_PREP_BACKENDS,  # every backend (kernels.py)
))
PREFILL = register_op(Op(
    "attention_prefill", "attention",
    "attention of a T > 1 chunk over KV cache + chunk (head dim 256, GQA)",
    kernel_backends=kernels.PREFILL_BACKENDS,  # simulator only until timed on a GPU (kernels.py)
    trial_backends=GPU_BACKENDS - kernels.PREFILL_BACKENDS,
))
DECODE = register_op(Op(
    "attention_decode", "attention",
    "one query row per sequence over the KV cache (GQA)",
    switches=("coalesced_kv", "gqa_packing"),
    kernel_backends=kernels.DECODE_BACKENDS,  # not CUDA: slower than stock's SDPA there (kernels.py)
    trial_backends=GPU_BACKENDS - kernels.DECODE_BACKENDS,
))
LONG_CONTEXT = register_op(Op(
    "attention_decode_long", "attention",
    "decode attention at long context: fixed KV blocks in parallel, then merged",
    switches=("fixed_block_attention", "coalesced_kv", "gqa_packing", "fused_output_gate"),
    kernel_backends=kernels.LONG_BACKENDS,
    trial_backends=GPU_BACKENDS - kernels.LONG_BACKENDS,
))
DECODE_BATCH = register_op(Op(
    "attention_decode_batch", "attention",
    "one query row per sequence of a batch (BatchKVCache, rows of their own lengths): fixed KV blocks of each "
    "row's own length in parallel, then merged",
    switches=("fixed_block_attention", "coalesced_kv", "gqa_packing"),
    kernel_backends=kernels.BATCH_BACKENDS,  # Metal: trial until timed against stock's masked attention (kernels.py)
    trial_backends=GPU_BACKENDS - kernels.BATCH_BACKENDS,
))
DECODE_QUANTIZED = register_op(Op(
    "attention_decode_quantized", "attention",
    "one query row per sequence over a quantized (2/4/8-bit) KV cache, dequantised in the kernel (GQA)",
    switches=("gqa_packing", "fixed_block_attention"),
    kernel_backends=kernels.QUANTIZED_DECODE_BACKENDS,  # Metal: trial until timed there (kernels.py)
    trial_backends=GPU_BACKENDS - kernels.QUANTIZED_DECODE_BACKENDS,
))
QKV_PROJ = register_op(Op(
    "attention_qkv_proj", "attention",
    "q/k/v projections of a decode-sized call as one quantised matmul over their weights concatenated "
    "at patch time (MLX's own kernel; same bits; lily_mlx.core.projections)",
    switches=("fused_qkv_proj",),
    kernel_backends=frozenset({"metal", "sim", "cuda"}),
))
