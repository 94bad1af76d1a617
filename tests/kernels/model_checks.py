"""Model-level helpers shared by the kernel tests."""

from typing import Tuple

import mlx.core as mx
import numpy as np

from lily_mlx.consistency import teacher_forced_logits  # noqa: F401  (the one loop; tests import it here)

# A greedy choice is a property of the model only where its top-2 logit margin exceeds the bf16 noise
# of the logits themselves (the embedded model's logits are bf16: one ulp is 1/32..1/8 at their scale,
# and any rounding change anywhere in the network moves them by a few ulps, stock's own Metal vs CPU
# paths included).
NEAR_TIE = 0.25


def decided_positions(stock_logits: mx.array) -> Tuple[np.ndarray, int]:
    """Positions where stock's top-2 logit margin exceeds NEAR_TIE (bool [n]), and the first position
    where it does not (n when every position is decided): greedy tokens must agree up to there."""
    top2 = mx.sort(stock_logits, axis=-1)[:, -2:]
    decided = np.array(top2[:, 1] - top2[:, 0]) > NEAR_TIE
    first_tie = int(np.argmin(decided)) if not decided.all() else len(decided)
    return decided, first_tie
