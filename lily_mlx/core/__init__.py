"""The bottom layer of lily-mlx: switches, backend choice, the op and kernel registries, dispatch,
environment checks and logging. Imports nothing else from lily-mlx except ``lily_mlx.msl`` (the
kernel toolchains, which stand alone)."""
