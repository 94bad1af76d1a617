"""The machine code (SASS) of lily's kernels for the H200 (sm_90a) without a GPU: the instruction mix of each loop.

    python -m lily_dev.sass --family moe --match "regtile[T=mlx.core.bfloat16, MT=None, NT=64]"
    python -m lily_dev.sass --family moe --match regtile --loops 3     # the 3 loops with the most FFMAs each
    python -m lily_dev.sass --family attention --match partials

Needs nvcc (front end and ptxas) and nvdisasm (on PATH, or the ``nvidia-cuda-nvdisasm`` package of the test
extras). For each kernel: ptxas's registers, stack frame and spills, then its loops (each backward branch:
addresses, instructions, FFMAs and their share, threadgroup-memory (LDS/STS), local-memory (LDL/STL) and device
(LDG/STG) accesses, the most frequent opcodes). Static code, not a timing: it counts what "fewer instructions per
FMA" means in a kernel's hot loop before a GPU run times the change (ptxas here may be older than the driver's).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from . import compile_check

_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.+?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?(?:0x([0-9a-f]+)|`\((\.L_x_\d+)\))")


def nvdisasm_path() -> Optional[str]:
    """nvdisasm on PATH, else the one the ``nvidia-cuda-nvdisasm`` package installs."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for candidate in sorted(Path(root).glob("cu*/bin/nvdisasm")):
            return str(candidate)
    return None


def opcode(text: str) -> str:
    """``@!P0 LDS.128 R4, [R2]`` -> ``LDS``: the mnemonic without predicate and modifiers."""
    words = text.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def instructions(sass: str) -> tuple:
    """([(address, text)], {label: address}) of a SASS listing (``nvdisasm -c``: branches to labels; ``cuobjdump
    -sass``: branches to addresses)."""
    code, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _INSTRUCTION.match(line)
        if m:
            address = int(m.group(1), 16)
            labels.update({name: address for name in pending})
            pending = []
            code.append((address, m.group(2)))
    return code, labels


@dataclass
class Loop:
    start: int
    end: int  # the address of the backward branch
    ops: Dict[str, int] = field(default_factory=dict)
    inner: bool = True  # no other loop inside it

    @property
    def count(self) -> int:
        return sum(self.ops.values())

    def share(self, name: str) -> float:
        return self.ops.get(name, 0) / max(self.count, 1)


def loops(sass: str) -> List[Loop]:
    """Every loop of the listing (a backward branch and its target), outermost first by start address."""
    code, labels = instructions(sass)
    found = []
    for address, text in code:
        target = _BRANCH_TARGET.search(text)
        if target is None:
            continue
        start = int(target.group(1), 16) if target.group(1) else labels.get(target.group(2), address + 1)
        if start <= address:
            ops = collections.Counter(opcode(t) for a, t in code if start <= a <= address)
            found.append(Loop(start, address, dict(ops)))
    for loop in found:
        loop.inner = not any(o is not loop and loop.start <= o.start and o.end <= loop.end for o in found)
    return sorted(found, key=lambda lp: (lp.start, -lp.end))


def kernel_sass(unit: str) -> tuple:
    """(ptxas -v output, SASS listing) of one CUDA translation unit."""
    tool = nvdisasm_path()
    if tool is None:
        raise FileNotFoundError("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        ok, out = compile_check.compile_nvcc(unit, extra_flags=("-Xptxas", "-v"), cubin_out=cubin)
        if not ok:
            raise RuntimeError(out[-2000:])
        listing = subprocess.run([tool, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    return out, listing


def loop_table(found: List[Loop], top: int) -> str:
    lines = ["| loop (addresses) | inner | instructions | FFMA | FFMA share | LDS / STS | LDL / STL | LDG / STG | most frequent |",
             "|---|---|---|---|---|---|---|---|---|"]
    for lp in sorted(found, key=lambda lp: (-lp.ops.get("FFMA", 0), -lp.share("FFMA")))[:top]:
        common = ", ".join(f"{k} {v}" for k, v in sorted(lp.ops.items(), key=lambda kv: -kv[1])[:6])
        lines.append(f"| {lp.start:#x}-{lp.end:#x} | {'yes' if lp.inner else 'no'} | {lp.count} | "
                     f"{lp.ops.get('FFMA', 0)} | {100 * lp.share('FFMA'):.0f} % | {lp.ops.get('LDS', 0)} / "
                     f"{lp.ops.get('STS', 0)} | {lp.ops.get('LDL', 0)} / {lp.ops.get('STL', 0)} | "
                     f"{lp.ops.get('LDG', 0)} / {lp.ops.get('STG', 0)} | {common} |")
    return "\n".join(lines)


def units(family: str) -> Dict[str, str]:
    from . import resource_usage

    if family == "moe":
        units = resource_usage.moe_gemm_units()
        for direct in (False, True):
            name = "moe_gemv_down_combine" + ("_direct" if direct else "")
            units[name] = resource_usage.down_combine_unit(direct=direct)[0]
        units["moe_gemv_down_combine[PD=1]"] = resource_usage.down_combine_unit(in_flight=1)[0]
        units["moe_gemv_down_combine[GS=1]"] = resource_usage.down_combine_unit(simd_barriers=True)[0]
        units["moe_gemv_gate_up_swiglu_routed"] = resource_usage.gate_up_gemv_unit()
        for in_flight, layout in ((2, None), (4, (16, 128)), (8, (16, 64))):  # candidates: GATE_UP_IN_FLIGHT
            units[f"moe_gemv_gate_up_swiglu_routed[PD={in_flight}]"] = resource_usage.gate_up_gemv_unit(
                in_flight=in_flight, layout=layout)
        return units
    if family == "attention":
        return resource_usage.attention_units()
    if family == "deltanet":
        return {name.removeprefix("custom_kernel_").rsplit("_", 1)[0]: unit
                for name, unit in resource_usage.record_deltanet_units().items()}
    raise ValueError(f"family must be moe, attention or deltanet, not {family!r}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lily_dev.sass", description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="moe",
                   help="moe (the grouped GEMMs, every tile form; the decode gate/up GEMV and the "
                        "down+combine kernel's two layouts), attention (decode) or deltanet")
    p.add_argument("--match", default="", help="only kernels whose name contains this text")
    p.add_argument("--loops", type=int, default=5, help="loops shown per kernel (most FFMAs first, then FFMA share)")
    args = p.parse_args(argv)
    if compile_check.nvcc_path() is None or nvdisasm_path() is None:
        print("needs nvcc (CUDA toolkit) and nvdisasm (pip install nvidia-cuda-nvdisasm)", file=sys.stderr)
        return 2
    chosen = {name: unit for name, unit in units(args.family).items() if args.match in name}
    if not chosen:
        print(f"no {args.family} kernel matches {args.match!r}", file=sys.stderr)
        return 2
    for name, unit in chosen.items():
        ptxas, listing = kernel_sass(unit)
        usage = "; ".join(line.replace("ptxas info    :", "").strip() for line in ptxas.splitlines()
                          if "registers" in line or "stack frame" in line)
        print(f"### {name}\n\nptxas: {usage}\n\n{loop_table(loops(listing), args.loops)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
