"""``python -m lily_mlx tune``: check and time every kernel choice on this machine, write the tune
profile that ``patch()`` applies (``lily_mlx.core.tune_profile``). Modules: ``tune`` (the steps and
the command), ``layers`` (one layer per op family at a shape class), ``report`` (Markdown)."""

from .tune import main  # noqa: F401
