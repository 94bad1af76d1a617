"""``python -m lily_mlx`` (also the ``lily-mlx`` script) and the ``--lily`` flags of MLX-LM's CLIs.

Subcommands:
    generate        mlx_lm.generate with lily-mlx on (all MLX-LM flags pass through)
    chat            mlx_lm.chat with lily-mlx on (all MLX-LM flags pass through)
    server          mlx_lm.server with lily-mlx on (all MLX-LM flags pass through)
    benchmark       mlx_lm.benchmark with lily-mlx on (all MLX-LM flags pass through)
    switches        table of switches (default, state, phase, description) and op backends
    embedded-model  print the embedded tiny model's folder (build it first if needed)
    consistency     teacher-forced lily vs stock comparison (top-1 agreement, perplexity, logits)
    tune            check and time every kernel on this machine; write the profile --lily applies
    build-random    write full-size random 4-bit Qwen3.6-35B-A3B weights (benchmarks)

How ``--lily`` reaches MLX-LM: the installed ``lily_mlx_hooks.pth`` puts a small import hook
(``lily_mlx_patches``) on ``sys.meta_path``; when ``mlx_lm.generate``, ``mlx_lm.server``, ``mlx_lm.chat`` or
``mlx_lm.benchmark`` (or ``cache_prompt``, ``perplexity``: ``CLI_MODULES``) is imported, it calls :func:`instrument`
on the module, which wraps the module's ``main``.
Only while that ``main`` runs, the module sees an ``ArgumentParser`` that also knows the lily flags and a ``load`` /
``sharded_load`` that patches the loaded model when ``--lily`` was given. Nothing else in MLX-LM
changes, and without ``--lily`` the CLI runs exactly as stock.

This module imports only the standard library at import time (it is imported by the hook).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
import types
from typing import Callable, List, Optional

PROG = "python -m lily_mlx"
_ORIGINAL_MAIN = "_lily_original_main"

# Subcommands implemented elsewhere: name -> (module, help).
_DELEGATED = {
    "embedded-model": ("lily_mlx.models.embedded",
                       "print the embedded tiny Qwen3.6 model's folder (last line), building it if needed"),
    "consistency": ("lily_mlx.consistency",
                    "teacher-forced lily vs stock MLX-LM: top-1 agreement, perplexities, max |logit diff|"),
    "build-random": ("lily_mlx.models.random_weights",
                     "write full-size random 4-bit Qwen3.6-35B-A3B weights for benchmarks"),
    "tune": ("lily_mlx.tuning",
             "check and time every kernel on this machine; write the profile --lily / patch() apply"),
}
_MLX_LM = {
    "generate": "mlx_lm.generate with lily-mlx on; every mlx_lm.generate flag passes through",
    "chat": "mlx_lm.chat with lily-mlx on; every mlx_lm.chat flag passes through",
    "server": "mlx_lm.server with lily-mlx on; every mlx_lm.server flag passes through",
    "benchmark": "mlx_lm.benchmark with lily-mlx on; every mlx_lm.benchmark flag passes through",
}


# --------------------------------------------------------------------------------------------------
# The lily flags inside MLX-LM's own argument parsers
# --------------------------------------------------------------------------------------------------


class _Session:
    """Lily state of one run of an MLX-LM CLI ``main``."""

    def __init__(self, module_name: str, force: bool):
        self.module_name = module_name
        self.force = force  # python -m lily_mlx generate|server: lily on without --lily
        self.active = False  # set once the parsed arguments turned lily on


def add_lily_arguments(parser: argparse.ArgumentParser, force: bool = False) -> None:
    """Add ``--lily``, ``--lily-disable``, ``--lily-enable``, ``--lily-backend`` to ``parser``."""
    from .core import switches
    from .core.backend import CHOICES

    names = ", ".join(switches.SWITCHES)
    group = parser.add_argument_group(
        "lily-mlx",
        "Qwen3.5/3.6 kernels swapped into MLX-LM's model (same outputs, faster). "
        + ("lily-mlx is on for this command." if force else "Off unless --lily is given."),
    )
    group.add_argument(
        "--lily", action="store_true",
        help="run the model with lily-mlx (Qwen3.5/3.6 family: qwen3_5, qwen3_5_moe, qwen3_next)",
    )
    group.add_argument(
        "--lily-disable", metavar="A,B", default=None,
        help=f"comma-separated lily-mlx switches to turn off (ablation); valid: {names}",
    )
    group.add_argument(
        "--lily-enable", metavar="A,B", default=None,
        help="comma-separated lily-mlx switches to turn on (same names)",
    )
    group.add_argument(
        "--lily-backend", choices=CHOICES, type=str.lower, default=None,
        help="kernel backend (sets LILY_BACKEND; default auto: metal, else cuda, else reference)",
    )


def _fail(message: str) -> None:
    """A one-line error on stderr and exit status 2 (as argparse), before any model loads."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _apply_lily_arguments(ns, parser: argparse.ArgumentParser, session: _Session) -> None:
    from .core import environment, switches
    from .core.backend import resolve_backend
    from .patch import check_environment, environment_problems, prefill_step_size, unsupported_model_message

    if not (session.force or getattr(ns, "lily", False)):
        given = [f for f, v in (("--lily-disable", ns.lily_disable), ("--lily-enable", ns.lily_enable),
                                ("--lily-backend", ns.lily_backend)) if v]
        if given:
            parser.error(f"{', '.join(given)} need(s) --lily")
        problems = environment_problems()
        if problems:  # stock MLX-LM runs regardless; one line so the typo gets noticed
            print(f"[lily_mlx] warning: ignored without --lily: {'; '.join(problems)}", file=sys.stderr)
        return
    try:
        off = switches.parse_list(ns.lily_disable)
        on = switches.parse_list(ns.lily_enable)
        both = sorted(set(off) & set(on))
        if both:
            raise ValueError(f"--lily-disable and --lily-enable both name {', '.join(both)}")
        if ns.lily_backend:
            resolve_backend(ns.lily_backend)
    except (ValueError, RuntimeError) as e:
        parser.error(str(e))
    if ns.lily_backend:
        os.environ["LILY_BACKEND"] = ns.lily_backend
    try:
        check_environment()
    except environment.LilyConfigError as e:
        _fail(f"--lily: {e}")
    model_path = getattr(ns, "model", None)
    unsupported = unsupported_model_message(model_path) if isinstance(model_path, str) else None
    if unsupported:  # before loading (the server would start and then fail every request)
        _fail(f"--lily: {unsupported}; run without --lily for stock MLX-LM")
    switches.disable(*off)
    switches.enable(*on)
    # chunked_prefill lives at the generation level: it sets MLX-LM's prompt chunk size.
    if getattr(ns, "prefill_step_size", None) is not None:
        ns.prefill_step_size = prefill_step_size(ns.prefill_step_size)
    elif "chunked_prefill" in off and not hasattr(ns, "prefill_step_size"):
        print(f"[lily_mlx] note: --lily-disable chunked_prefill changes nothing in {session.module_name}, which has "
              "no prompt chunk size (--prefill-step-size)", file=sys.stderr)
    session.active = True


def _parser_class(session: _Session) -> type:
    class LilyArgumentParser(argparse.ArgumentParser):
        """MLX-LM's parser plus the lily flags; applies them right after parsing."""

        def parse_known_args(self, args=None, namespace=None):
            if not getattr(self, "_lily_flags_added", False):
                self._lily_flags_added = True
                add_lily_arguments(self, force=session.force)
            ns, extras = super().parse_known_args(args, namespace)
            _apply_lily_arguments(ns, self, session)
            return ns, extras

    return LilyArgumentParser


class _ArgparseWithLily(types.ModuleType):
    """Stands in for ``argparse`` in an MLX-LM CLI module while its ``main`` runs."""

    def __init__(self, parser_cls: type):
        super().__init__("argparse")
        self.ArgumentParser = parser_cls

    def __getattr__(self, name):
        return getattr(argparse, name)


def _patching_loader(load_fn: Callable, session: _Session) -> Callable:
    @functools.wraps(load_fn)
    def load(*args, **kwargs):
        out = load_fn(*args, **kwargs)
        if session.active:
            from .core.log import log_once
            from .patch import is_patched, patch, patch_report

            # MLX-LM loads a draft model with a bare load(path): patch it when it is supported,
            # otherwise keep it stock with a warning. The main model must be supported.
            try:
                model = patch(out[0], strict=bool(kwargs))
            except (ValueError, RuntimeError) as e:
                if session.module_name != "mlx_lm.server":  # one user: a clean error
                    sys.exit(f"error: --lily: {e}")
                raise  # mlx_lm.server returns load errors to the client that asked

            if not is_patched(model):  # an unsupported draft model, left stock
                return out
            log_once(f"cli-patched:{id(model)}", patch_report(model).summary())
        return out

    return load


def run_mlx_lm_main(module, force: bool = False):
    """Run MLX-LM CLI ``module``'s original ``main`` with the lily flags available."""
    main = getattr(module.main, _ORIGINAL_MAIN, module.main)
    session = _Session(module.__name__, force)
    saved = {n: module.__dict__[n] for n in ("argparse", "load", "sharded_load")
             if n in module.__dict__}
    module.argparse = _ArgparseWithLily(_parser_class(session))
    for n in ("load", "sharded_load"):
        if n in saved:
            setattr(module, n, _patching_loader(saved[n], session))
    try:
        return main()
    finally:
        for n in ("argparse", "load", "sharded_load"):
            if n in saved:
                module.__dict__[n] = saved[n]
            else:
                module.__dict__.pop(n, None)


def instrument(module) -> None:
    """Give MLX-LM CLI ``module`` (``mlx_lm.generate`` / ``chat`` / ``server`` / ``benchmark``) the lily flags.
    Idempotent."""
    main = getattr(module, "main", None)
    if main is None or hasattr(main, _ORIGINAL_MAIN):
        return

    @functools.wraps(main)
    def main_with_lily():
        return run_mlx_lm_main(module)

    setattr(main_with_lily, _ORIGINAL_MAIN, main)
    module.main = main_with_lily


def _run_mlx_lm(name: str, argv: List[str]) -> int:
    module = importlib.import_module(f"mlx_lm.{name}")
    sys.argv = [f"{PROG} {name}", *argv]
    run_mlx_lm_main(module, force=True)
    return 0


# --------------------------------------------------------------------------------------------------
# switches
# --------------------------------------------------------------------------------------------------


def _table(header: List[str], rows: List[List[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def switches_main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} switches",
        description="Print every lily-mlx switch (name, default, current state, phase, description) "
        "and, per op, the backend it would use on this machine. The current state reflects "
        "LILY_DISABLE / LILY_ENABLE and the flags below; the backend reflects LILY_BACKEND.",
    )
    parser.add_argument("--lily-disable", metavar="A,B", default=None,
                        help="show the state with these switches turned off")
    parser.add_argument("--lily-enable", metavar="A,B", default=None,
                        help="show the state with these switches turned on")
    parser.add_argument("--lily-backend", default=None,
                        help="show op backends for this backend (auto|metal|cuda|sim|reference)")
    args = parser.parse_args(argv)

    from .core import dispatch, switches, tune_profile
    from .core.backend import resolve_backend
    from .ops import load_all, op_backend

    try:
        backend = resolve_backend(args.lily_backend)
        off, on = switches.parse_list(args.lily_disable), switches.parse_list(args.lily_enable)
    except (ValueError, RuntimeError) as e:
        parser.error(str(e))
    if args.lily_backend:
        os.environ["LILY_BACKEND"] = args.lily_backend
    ops = load_all()
    dispatch.resolve()  # as patch() does: the tune profile's choices, then the flags on top
    switches.disable(*off)
    switches.enable(*on)
    state = switches.state()
    profile = dispatch.active_profile()
    pinned = profile.reference_ops if profile is not None else {}

    def backends_for(name: str) -> str:
        if switches.SWITCHES[name].family == "generation":
            return "mlx-lm"  # chooses MLX-LM's prompt chunk size, no kernel
        used = sorted({op_backend(op.name, backend) for op in ops.values() if name in op.switches})
        return ",".join(used) if used else "-"

    def kernel_of(name: str) -> str:
        if switches.SWITCHES[name].family == "generation":
            return "-"
        mine = [op for op in ops.values() if name in op.switches]
        if any(op.kernel_backends for op in mine):
            return "written"
        trials = [op.name for op in mine if op.trial_backends]
        if trials:  # acts only where LILY_TRIAL_OPS (or a tune profile) turns the trial kernel on
            return f"trial kernel only (LILY_TRIAL_OPS={','.join(trials)})"
        return "no kernel yet (switch has no effect)"

    rows = [
        [s.name, "on" if s.default else "off", "on" if state[s.name] else "off", s.phase, s.family,
         backends_for(s.name), kernel_of(s.name), s.description]
        for s in switches.SWITCHES.values()
    ]
    print(f"lily-mlx switches (backend in force: {backend})")
    print(_table(["switch", "default", "state", "phase", "family", "backend", "kernel", "description"], rows))
    print()
    trials_on = profile.kernel_ops if profile is not None else {}
    op_rows = [
        [op.name, op.family, ",".join(op.switches) or "-", op_backend(op.name, backend),
         ",".join(sorted(op.kernel_backends)) or ("-" if op.trial_backends else "none (stock's fallback path by design)"),
         ",".join(sorted(op.trial_backends)) or "-",
         pinned.get(op.name, "") or trials_on.get(op.name, "")]
        for op in ops.values()
    ]
    print("ops: backend each op would use here (kernel only where it has one for this backend and the "
          "tune profile does not pin it to its reference; a trial kernel only where the tune profile or "
          "LILY_TRIAL_OPS turned it on; otherwise its reference in plain MLX ops)")
    print(_table(["op", "family", "switches", "backend", "kernels for", "trial kernels for", "tune profile"],
                 op_rows))
    print()
    print(tune_profile.describe(profile))
    if profile is not None:
        for name, why in profile.switches_off.items():
            print(f"  switch {name} off: {why}")
        print(f"  (tuned on {profile.model}; `{PROG} tune` again after an update, LILY_TUNE=off to ignore)")
    print()
    print("switch off = the write-up's ablation variant (never stock); every state computes stock's "
          "function. Turn off with --lily-disable a,b or LILY_DISABLE=a,b.")
    return 0


# --------------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------------


def _delegate(name: str, argv: List[str]) -> int:
    module_name, _ = _DELEGATED[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        module = None
    entry = getattr(module, "main", None)
    if entry is None:
        print(f"{PROG} {name}: not available in this build ({module_name}.main is missing)",
              file=sys.stderr)
        return 2
    return int(entry(list(argv)) or 0)


def usage() -> str:
    width = max(len(n) for n in list(_MLX_LM) + ["switches"] + list(_DELEGATED))
    lines = [f"usage: {PROG} <command> [args...]", "",
             "lily-mlx: Qwen3.5/3.6-specific kernels swapped into MLX-LM's own model.", "",
             "commands:"]
    items = list(_MLX_LM.items()) + [("switches", "list switches, their state and each op's backend")]
    items += [(n, h) for n, (_, h) in _DELEGATED.items()]
    lines += [f"  {n.ljust(width)}  {h}" for n, h in items]
    lines += ["", f"`{PROG} <command> --help` lists that command's flags. generate, chat, server and benchmark take",
              "every MLX-LM flag plus --lily-disable A,B, --lily-enable A,B, --lily-backend B.",
              "Environment: LILY_BACKEND=auto|metal|cuda|sim|reference, LILY_DISABLE=a,b,",
              "LILY_ENABLE=a,b, LILY_REFERENCE_OPS=op_or_family,... (keep those on their reference),",
              "LILY_ALLOW_UNTESTED=1 (patch under untested MLX/MLX-LM versions), LILY_TUNE=off (ignore",
              "the tune profile), LILY_TUNE_DIR=folder (where `tune` writes profiles and patch() reads",
              "them). A bad value is one warning line without --lily and a one-line error (exit 2) with it."]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from . import __version__

        print(__version__)
        return 0
    command, rest = argv[0], argv[1:]
    if command in _MLX_LM:
        return _run_mlx_lm(command, rest)
    if command == "switches":
        return switches_main(rest)
    if command in _DELEGATED:
        return _delegate(command, rest)
    print(usage(), file=sys.stderr)
    print(f"\n{PROG}: unknown command {command!r}", file=sys.stderr)
    return 2
