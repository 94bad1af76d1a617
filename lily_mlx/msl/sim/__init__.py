"""CPU simulator for ``mx.fast.metal_kernel`` kernels (see docs/simulator.md).

``metal_kernel(...)`` has exactly the signature and call convention of ``mx.fast.metal_kernel``;
the kernel text MLX would compile is translated to C++20, compiled against a Metal-compatibility
prelude and run with one cooperative fiber per GPU thread.
"""

from .build import CompileError
from .kernel import (
    DivergenceError,
    MetalKernel,
    MisalignedAccessError,
    OutOfBoundsError,
    RaceError,
    SimulatorError,
    metal_kernel,
)

__all__ = [
    "metal_kernel",
    "MetalKernel",
    "SimulatorError",
    "OutOfBoundsError",
    "DivergenceError",
    "RaceError",
    "MisalignedAccessError",
    "CompileError",
]
