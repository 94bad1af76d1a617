"""Imported by ``lily_mlx_hooks.pth`` at interpreter start: put the MLX-LM CLI hook on sys.meta_path.

Standard library only, and nothing is imported until one of ``CLI_MODULES`` is.
"""

import sys

# MLX-LM CLI modules that get the --lily flags.
CLI_MODULES = frozenset({"mlx_lm.generate", "mlx_lm.chat", "mlx_lm.server", "mlx_lm.benchmark", "mlx_lm.cache_prompt",
                         "mlx_lm.perplexity"})


class _InstrumentingLoader:
    """Wraps the real loader: runs the module as usual, then hands it to lily_mlx.cli.instrument."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):  # get_code, get_source, is_package, ... of the real loader
        return getattr(self._loader, name)

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            from lily_mlx.cli import instrument
        except ImportError:  # lily_mlx uninstalled but this hook left behind: stay out of the way
            return
        try:
            instrument(module)
        except Exception as e:  # never break MLX-LM because of lily-mlx
            print(f"[lily_mlx] could not add --lily to {module.__name__}: {e!r}", file=sys.stderr)


class LilyCliFinder:
    """Meta-path finder that only reacts to MLX-LM's CLI modules; finds them with the other finders."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname not in CLI_MODULES:
            return None
        for finder in sys.meta_path:
            if getattr(finder, "_lily_cli_finder", False):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _InstrumentingLoader(spec.loader)
        return spec


LilyCliFinder._lily_cli_finder = True


def install() -> None:
    if not any(getattr(f, "_lily_cli_finder", False) for f in sys.meta_path):
        sys.meta_path.insert(0, LilyCliFinder)


install()
