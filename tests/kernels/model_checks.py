"""Model-level helpers shared by the kernel tests."""

from typing import Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

# A greedy choice is a property of the model only where its top-2 logit margin exceeds the bf16 noise
# of the logits themselves (the embedded model's logits are bf16: one ulp is 1/32..1/8 at their scale,
# and any rounding change anywhere in the network moves them by a few ulps, stock's own Metal vs CPU
# paths included).
NEAR_TIE = 0.25


def teacher_forced_logits(model, prompt: mx.array, tokens) -> mx.array:
    """Logits predicting each of ``tokens`` from the same reference prefix: [len(tokens), vocab] fp32.

    The prompt's last position predicts ``tokens[0]``; each following step is fed the reference token,
    so an early difference between engines cannot steer later inputs."""
    cache = make_prompt_cache(model)
    logits = [model(prompt[None], cache=cache)[0, -1]]
    for t in tokens[:-1]:
        logits.append(model(mx.array([[t]]), cache=cache)[0, -1])
    return mx.stack(logits).astype(mx.float32)  # [n, vocab]


def decided_positions(stock_logits: mx.array) -> Tuple[np.ndarray, int]:
    """Positions where stock's top-2 logit margin exceeds NEAR_TIE (bool [n]), and the first position
    where it does not (n when every position is decided): greedy tokens must agree up to there."""
    top2 = mx.sort(stock_logits, axis=-1)[:, -2:]
    decided = np.array(top2[:, 1] - top2[:, 0]) > NEAR_TIE
    first_tie = int(np.argmin(decided)) if not decided.all() else len(decided)
    return decided, first_tie
