"""``bench.decode_profile.host_profile`` (``--mode decode-profile --host-profile ENGINE``) on the tiny random
model (simulator): the profile reports the build per step without the profiler (trace calls and layer replays
apart), names the patched layers' functions in both orderings, and leaves the model unpatched."""

import lily_mlx
from bench import decode_profile
from bench.model_setup import load_model


def test_host_profile_lists_the_patched_forward(monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", "sim")
    monkeypatch.setenv("LILY_TUNE", "off")
    model, _ = load_model(None, "tiny", log=None)
    vocab = model.args.text_config["vocab_size"]
    text = decode_profile.host_profile(model, "lily-off:split_router", context=24, steps=2, vocab=vocab, top=40)
    assert text.startswith("build of one decode step at context 24, engine lily-off:split_router, without the "
                           "profiler: ")
    assert "| piece (owner:kind) | calls/step | median us/call | ms/step |" in text  # (none traced on sim)
    assert "build of 2 decode steps at context 24, engine lily-off:split_router" in text
    assert "by tottime" in text and "by cumulative" in text and "callers of the functions" in text
    assert "sparse_moe_forward" in text and "decoder_layer_forward" in text
    assert not lily_mlx.is_patched(model)
