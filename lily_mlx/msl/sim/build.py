"""Compile translated kernels into shared libraries, cached by content hash.

Binaries live under ``${LILY_MSL_CACHE:-~/.cache/lily_mlx/msl}/<hash>.so`` (the translated source
next to it as ``<hash>.cpp``); they are written to a temporary name and renamed into place, so
concurrent processes (pytest-xdist workers) can share the cache.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from typing import Dict

PRELUDE_DIR = Path(__file__).resolve().parent
PRELUDE_FILES = ("prelude.h", "metal_types.h", "metal_math.h", "runtime.h", "simd.h", "simdgroup_matrix.h", "launch.h",
                 "trace.h")
# -ffp-contract=off: no fused multiply-add unless the kernel asks for fma() (bitwise comparisons
# between kernels must not depend on the host compiler's contraction choices).
CXX_FLAGS = ("-std=c++20", "-O1", "-fPIC", "-fno-strict-aliasing", "-ffp-contract=off",
             "-fno-math-errno", "-Wno-unknown-pragmas", "-Wno-attributes", "-pthread",
             "-Werror=vla")  # arrays sized at run time: a GNU extension, a compile error in Metal


class CompileError(RuntimeError):
    """The kernel did not compile; the message shows the compiler output and the numbered source."""


def cache_dir() -> Path:
    d = os.environ.get("LILY_MSL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lily_mlx", "msl")
    p = Path(d)
    p.mkdir(parents=True, exist_ok=True)
    return p


@lru_cache(maxsize=None)
def compiler() -> str:
    for c in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if c and shutil.which(c):
            return c
    raise CompileError("no C++ compiler found (set CXX, or install g++ or clang++)")


@lru_cache(maxsize=None)
def _toolchain_key() -> str:
    h = hashlib.sha256()
    for name in PRELUDE_FILES:
        h.update((PRELUDE_DIR / name).read_bytes())
    try:
        h.update(subprocess.run([compiler(), "--version"], capture_output=True, text=True).stdout.encode())
    except OSError:
        pass
    h.update(" ".join(CXX_FLAGS).encode())
    return h.hexdigest()


_loaded: Dict[str, ctypes.CDLL] = {}
_lock = threading.Lock()


def numbered(text: str) -> str:
    return "\n".join(f"{i:4d}| {line}" for i, line in enumerate(text.splitlines(), 1))


TRACE_DEFINE = "#define LILY_MSL_TRACE 1\n"


def build(cpp: str, metal_text: str, kname: str, traced: bool = False) -> ctypes.CDLL:
    """The loaded library for translated source ``cpp`` (compiling it if not cached). ``traced``
    builds instrument every load and store (-fsanitize=thread code generation, hooks defined in
    trace.h, no sanitizer runtime) for the race check."""
    if traced:
        cpp = TRACE_DEFINE + cpp
    key = hashlib.sha256((_toolchain_key() + cpp).encode()).hexdigest()[:32]
    with _lock:
        lib = _loaded.get(key)
        if lib is not None:
            return lib
        d = cache_dir()
        so = d / f"{key}.so"
        if not so.exists():
            _compile(cpp, metal_text, kname, d, key, so, traced)
        lib = ctypes.CDLL(str(so))
        lib.lily_sim_launch.restype = ctypes.c_int
        _loaded[key] = lib
        return lib


@lru_cache(maxsize=None)
def _pch_dir() -> str:
    """A directory holding the precompiled prelude (``prelude.h.gch``), built once per toolchain;
    "" if the compiler cannot precompile it (kernels then parse the prelude themselves)."""
    if os.environ.get("LILY_MSL_NO_PCH") == "1" or "g++" not in os.path.basename(compiler()):
        return ""
    d = cache_dir() / f"pch-{_toolchain_key()[:16]}"
    gch = d / "prelude.h.gch"
    if gch.exists():
        return str(d)
    d.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="prelude.", suffix=".gch.tmp", dir=d)
    os.close(fd)
    r = subprocess.run([compiler(), *CXX_FLAGS, "-x", "c++-header", str(PRELUDE_DIR / "prelude.h"), "-o", tmp],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(tmp)
        return ""
    os.replace(tmp, gch)
    return str(d)


def _compile(cpp: str, metal_text: str, kname: str, d: Path, key: str, so: Path, traced: bool = False) -> None:
    fd, tmp_src = tempfile.mkstemp(prefix=f"{key}.", suffix=".cpp", dir=d)
    with os.fdopen(fd, "w") as f:
        f.write(cpp)
    tmp_so = tmp_src[:-4] + ".so.tmp"
    tmp_o = tmp_src[:-4] + ".o"
    if traced:
        # Compile with the instrumentation, link without the sanitizer runtime (trace.h has the hooks).
        cmd = [compiler(), *CXX_FLAGS, "-fsanitize=thread", "-g", "-c", "-I", str(PRELUDE_DIR), tmp_src, "-o", tmp_o]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode == 0:
            r = subprocess.run([compiler(), "-shared", "-pthread", tmp_o, "-o", tmp_so], capture_output=True, text=True)
    else:
        pch = _pch_dir()
        cmd = [compiler(), *CXX_FLAGS, "-shared", *(["-I", pch] if pch else []), "-I", str(PRELUDE_DIR), tmp_src,
               "-o", tmp_so]
        r = subprocess.run(cmd, capture_output=True, text=True)
    if os.path.exists(tmp_o):
        os.unlink(tmp_o)
    if r.returncode != 0:
        os.unlink(tmp_src)
        if os.path.exists(tmp_so):
            os.unlink(tmp_so)
        raise CompileError(
            f"[lily_mlx.msl.sim] kernel {kname} failed to compile.\n"
            f"Compiler output (line numbers refer to the kernel text below):\n{_trim(r.stderr)}\n"
            f"Kernel text as MLX generates it:\n{numbered(metal_text)}"
        )
    os.replace(tmp_so, so)
    os.replace(tmp_src, d / f"{key}.cpp")


def _trim(stderr: str, limit: int = 60) -> str:
    """Compiler errors first; template back-traces cut short."""
    lines = [l for l in stderr.splitlines() if l.strip()]
    errors = [l for l in lines if ": error:" in l or "fatal error" in l]
    keep = errors[:20] if errors else lines[:limit]
    return "\n".join(keep)


def source_line_of(lib: ctypes.CDLL, pc_from_launch: int, kname: str) -> int:
    """Kernel-text line of a code address given relative to ``lily_sim_launch`` (traced builds carry
    debug information); 0 if binutils are not available."""
    nm, a2l = shutil.which("nm"), shutil.which("addr2line")
    if not (nm and a2l):
        return 0
    try:
        syms = subprocess.run([nm, "-D", lib._name], capture_output=True, text=True).stdout
        base = next(int(l.split()[0], 16) for l in syms.splitlines() if l.endswith(" lily_sim_launch"))
        out = subprocess.run([a2l, "-i", "-e", lib._name, hex(base + pc_from_launch)], capture_output=True,
                             text=True).stdout
    except (OSError, StopIteration, ValueError):
        return 0
    for line in out.splitlines():  # innermost frame first; the first kernel-text location wins
        file, _, num = line.rpartition(":")
        if file.endswith(f"{kname}.metal"):
            try:
                return int(num.split()[0])
            except ValueError:
                return 0
    return 0
