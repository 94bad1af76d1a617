"""Model-level helpers shared by the kernel tests."""

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


def teacher_forced_logits(model, prompt: mx.array, tokens) -> mx.array:
    """Logits predicting each of ``tokens`` from the same reference prefix: [len(tokens), vocab] fp32.

    The prompt's last position predicts ``tokens[0]``; each following step is fed the reference token,
    so an early difference between engines cannot steer later inputs."""
    cache = make_prompt_cache(model)
    logits = [model(prompt[None], cache=cache)[0, -1]]
    for t in tokens[:-1]:
        logits.append(model(mx.array([[t]]), cache=cache)[0, -1])
    return mx.stack(logits).astype(mx.float32)  # [n, vocab]
