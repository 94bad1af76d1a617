"""Device experiment (not shipped): decode at 4K with the fixed-block attention path from context 0 against
lily's default threshold (32K), in alternating bursts. The second engine is named lily-off:chunked_prefill
(a prefill-only switch: its decode is lily's) and runs with FIXED_BLOCK_MIN_CONTEXT = 0."""
import sys

import bench.decode_ab as ab
from lily_mlx.ops.attention import kernels as ak

DEFAULT = ak.FIXED_BLOCK_MIN_CONTEXT
original = ab.switches_off


def switches_off(engine):
    ak.FIXED_BLOCK_MIN_CONTEXT = 0 if engine == "lily-off:chunked_prefill" else DEFAULT
    return original(engine)


ab.switches_off = switches_off
sys.exit(ab.main(sys.argv[1:]))
