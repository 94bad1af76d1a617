"""lily-mlx benchmark harness and GPU checks (``python -m bench.run --help``)."""
