"""Integration tests: lily-mlx inside MLX-LM (patch, caches, sharding, CLIs, server)."""
