"""MSL toolchain for ``mx.fast.metal_kernel`` kernels, usable on its own:
``signature`` (the exact kernel text MLX generates), ``sim`` (CPU simulator), ``cuda`` (bridge)."""
