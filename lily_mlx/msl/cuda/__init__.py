"""Metal->CUDA bridge: run ``mx.fast.metal_kernel`` text on MLX's CUDA backend.

``metal_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
atomic_outputs=False)`` returns a kernel with ``mx.fast.metal_kernel``'s call convention built on
``mx.fast.cuda_kernel``. See docs/bridge.md for what is bridged and how.
"""

from .kernel import CudaMetalKernel, metal_kernel, mlx_cuda_translation_unit, prelude, wrap_like_mlx  # noqa: F401
from .translate import UnbridgeableError, translate  # noqa: F401
