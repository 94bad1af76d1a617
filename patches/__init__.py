"""lily-mlx's hooks into MLX-LM's command-line tools (installed as the package ``lily_mlx_patches``).

``lily_mlx_hooks.pth`` imports :mod:`lily_mlx_patches.startup` at interpreter start; that module only
puts an import finder on ``sys.meta_path`` (standard library only, nothing heavy). When
``mlx_lm.generate`` or ``mlx_lm.server`` is imported later, the finder lets the module load as usual
and then hands it to ``lily_mlx.cli.instrument``, which adds ``--lily`` and friends to its ``main``.
No MLX-LM file is edited; without ``--lily`` MLX-LM runs as stock.
"""
