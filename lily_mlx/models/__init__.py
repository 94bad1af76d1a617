"""Model builders for lily-mlx, in MLX-LM's own checkpoint format.

- ``embedded``: the embedded tiny Qwen3.6 (trained on stdlib docstrings, 4-bit like the real
  checkpoint), shipped in ``lily_mlx/embedded/qwen3_6_tiny``; ``embedded_model_path()``.
- ``random_weights``: full-size random 4-bit Qwen3.6-35B-A3B checkpoints for benchmarks;
  ``write_random_checkpoint()``.
- ``qwen3_6``: the Qwen3.6 configs (real 35B-A3B and the tiny one) in the mlx-community layout.
- ``corpus`` / ``tokenizer``: the offline training text and the byte-level BPE tokenizer.
"""
