"""One rank of the sharded-kernels test (``mlx.launch --backend ring -n 2``; not a test file).

Usage: shard_kernels_worker.py MODEL_DIR OUT_NPZ. Runs with ``LILY_BACKEND=sim``: each rank loads the
model sharded over the ring group, takes teacher-forced logits of stock and of lily (kernels on the
rank's head, expert and width slices) over a fixed prompt and continuation, records which kernels
lily launched, and writes them to OUT_NPZ.rank<r>.npz.
"""

import json
import sys

import mlx.core as mx
import numpy as np
from mlx_lm.utils import sharded_load

import lily_mlx
from lily_mlx.consistency import teacher_forced_logits
from lily_mlx.core.kernel_registry import record_launches

# 20 prompt tokens: the prefill chunk takes the MoE routing kernels and GEMMs (> 64 assignments).
PROMPT = [11, 200, 7, 93, 5, 41, 17, 250, 3, 66, 12, 8, 31, 150, 9, 77, 4, 120, 60, 2]
CONTINUATION = [19, 77, 140, 2]  # teacher-forced: 1 prefill position + 3 decode steps


def main():
    model_dir, out_path = sys.argv[1], sys.argv[2]
    group = mx.distributed.init(strict=True, backend="ring")
    model, _ = sharded_load(model_dir, tensor_group=group)
    prompt = mx.array(PROMPT)
    stock = teacher_forced_logits(model, prompt, CONTINUATION)
    lily_mlx.patch(model)
    with record_launches() as rec:
        lily = teacher_forced_logits(model, prompt, CONTINUATION)
    lily_mlx.unpatch(model)
    np.savez(f"{out_path}.rank{group.rank()}.npz", stock=np.asarray(stock), lily=np.asarray(lily),
             launched=np.array(json.dumps(sorted(rec.counts()))), size=group.size())


if __name__ == "__main__":
    main()
