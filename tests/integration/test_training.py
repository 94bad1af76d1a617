"""Training mode: a patched model gives stock's loss and gradients.

The kernels have no gradients (``mx.fast.metal_kernel`` defines no VJP), so a patched layer in
training mode runs stock's ops. Checked on the simulator backend, where every kernel path would
otherwise run: the embedded model is bf16 with 4-bit experts, and a 48-token batch routes
2 x 48 x 4 = 384 expert assignments per MoE layer, well past the grouped-GEMM threshold.
"""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import lily_mlx


def _loss_and_grads(model, tokens):
    def loss_fn(m):
        logits = m(tokens[:, :-1]).astype(mx.float32)
        return nn.losses.cross_entropy(logits, tokens[:, 1:]).mean()

    loss, grads = nn.value_and_grad(model, loss_fn)(model)
    mx.eval(loss, grads)
    return loss, dict(tree_flatten(grads))


def test_training_mode_gives_stock_gradients(loaded_model, monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", "sim")
    model, _ = loaded_model
    tokens = mx.random.randint(3, 1000, (2, 49), key=mx.random.key(7))
    model.train()
    try:
        stock_loss, stock_grads = _loss_and_grads(model, tokens)
        lily_mlx.patch(model)
        lily_loss, lily_grads = _loss_and_grads(model, tokens)
    finally:
        lily_mlx.unpatch(model)
        model.eval()
    assert stock_grads, "the model has no trainable parameters to compare"
    assert set(lily_grads) == set(stock_grads)
    assert lily_loss.item() == stock_loss.item()
    for name, g in stock_grads.items():
        assert mx.array_equal(lily_grads[name], g).item(), f"gradient of {name} differs from stock's"
    # The gradient reaches the layers before the MoE blocks, so the MoE backward mattered.
    assert any("layers.0." in n and mx.abs(g).max().item() > 0 for n, g in stock_grads.items())


def test_gradients_in_eval_mode_are_an_error_naming_the_fix(loaded_model, monkeypatch):
    """In eval mode the patched layers run the kernels, which have no gradient: a gradient through them is an error
    that says what to do (on a GPU MLX's custom kernels raise; the simulator does too, not silent zeros)."""
    from lily_mlx.msl.sim.kernel import NO_GRADIENT

    monkeypatch.setenv("LILY_BACKEND", "sim")
    model, _ = loaded_model
    tokens = mx.random.randint(3, 1000, (1, 9), key=mx.random.key(8))
    model.eval()
    lily_mlx.patch(model)
    try:
        with pytest.raises(ValueError, match="model.train"):
            _loss_and_grads(model, tokens)

    finally:
        lily_mlx.unpatch(model)
    assert "lily_mlx.unpatch" in NO_GRADIENT
