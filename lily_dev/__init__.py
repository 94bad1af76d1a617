"""Development-only helpers of lily-mlx, shared by ``tests/`` and ``bench/`` and not shipped in the wheel:
random MoE inputs and blocks (``moe_testing``), kernel microbenchmark cases (``moe_bench``,
``deltanet_bench``), MLX-LM's own DeltaNet kernels rebuilt for any kernel backend
(``deltanet_stock_kernels``) and the NVRTC compile check of every bridged kernel (``compile_check``).
The kernel-launch recorder is a supported hook of the package itself:
``lily_mlx.core.kernel_registry.record_launches``."""
