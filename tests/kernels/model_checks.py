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


def check_fallbacks_match_stock(op, cases, caplog, equal_nan: bool = False):
    """Run attention ``op`` on each fallback case twice: stock's attention bit for bit (quantized caches
    excepted: stock's quantized attention is not repeatable on CPU here), no kernel launch, one log
    line per case naming its reason. ``cases``: (reason, q, keys, values, mask, cache)."""
    import logging

    import mlx.core as mx

    from lily_mlx.core.kernel_registry import record_launches
    from lily_mlx.core.log import reset_log_once
    from lily_mlx.ops.attention import reference as attref

    reset_log_once()
    with caplog.at_level(logging.INFO, logger="lily_mlx"), record_launches() as rec:
        for _ in range(2):
            for reason, q, keys, values, mask, cache in cases:
                out = op(q, keys, values, scale=0.125, mask=mask, cache=cache)
                if not isinstance(keys, tuple):
                    stock = attref.attention_reference(q, keys, values, scale=0.125, mask=mask, cache=cache)
                    assert bool(mx.array_equal(out, stock, equal_nan=equal_nan).item()), reason
    assert rec.names() == []
    notes = [r.getMessage() for r in caplog.records if r.name == "lily_mlx"]
    assert len(notes) == len(cases), notes  # one line per case, not per call
    for (reason, *_), note in zip(cases, notes):
        assert reason in note, (reason, note)
    reset_log_once()


def one_decode_step(model, tokenizer, text: str, disable=(), enable=()):
    """(logits, names of the kernels launched) of ``model``'s first decode step after a prompt of ``text``, with the
    switches ``disable`` off and ``enable`` on for the prefill and the step."""
    from mlx_lm.models.cache import make_prompt_cache

    from lily_mlx.core import switches
    from lily_mlx.core.kernel_registry import record_launches

    prompt = mx.array([tokenizer.encode(text)])
    with switches.overrides(disable=list(disable), enable=list(enable)):
        cache = make_prompt_cache(model)
        mx.eval(model(prompt, cache=cache))
        with record_launches() as rec:
            out = model(prompt[:, -1:], cache=cache)
            mx.eval(out)
    return out, rec.names()
