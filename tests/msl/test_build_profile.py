"""``bench.build_profile`` on the tiny random model (simulator): the profile names the patched layers'
functions, counts the requested steps, and leaves the model unpatched."""

import lily_mlx
from bench import build_profile
from bench.model_setup import load_model


def test_build_profile_lists_the_patched_forward(monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", "sim")
    monkeypatch.setenv("LILY_TUNE", "off")
    model, _ = load_model(None, "tiny", log=None)
    text = build_profile.profile_build(model, "lily", context=24, steps=2, warmup=1, top=40)
    assert text.startswith("build of 2 decode steps at context 24, engine lily")
    assert "by tottime" in text and "by cumulative" in text
    assert "sparse_moe_forward" in text and "decoder_layer_forward" in text
    assert not lily_mlx.is_patched(model)
