"""``bench.decode_ab`` on the tiny random model (simulator): every engine decodes every turn, the first
engine's ratios are 1, the model ends unpatched, and the table names each engine."""

import lily_mlx
from bench import decode_ab
from bench.model_setup import load_model


def test_decode_ab_alternates_engines_and_reports_paired_ratios(monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", "sim")
    monkeypatch.setenv("LILY_TUNE", "off")
    model, _ = load_model(None, "tiny", log=None)
    lines = []
    result = decode_ab.run(model, ["lily", "lily-off:split_router", "stock"], context=24, bursts=3, burst_steps=2,
                           vocab=model.args.text_config["vocab_size"], log=lines.append)
    assert len(lines) == 3 and all(line.startswith("[decode-ab] turn") for line in lines)
    engines = result["engines"]
    assert list(engines) == ["lily", "lily-off:split_router", "stock"]
    assert engines["lily"]["ratio"] == 1.0 and engines["lily"]["ratio_range"] == [1.0, 1.0]
    for r in engines.values():
        assert len(r["tok_s_bursts"]) == 3 and min(r["tok_s_bursts"]) > 0
    assert not lily_mlx.is_patched(model)
    table = decode_ab.table_markdown(result)
    assert "| lily-off:split_router |" in table and "median ratio to lily" in table


def test_lily_trial_engines_set_and_restore_the_trial_kernels(monkeypatch):
    """``lily-trial:<op>`` engines run lily with those trial kernels on (LILY_TRIAL_OPS while the engine is
    in use, the user's own value back afterwards); a name that is not a trial kernel is refused."""
    import os

    import pytest

    from bench.e2e import Engines, is_lily, trial_ops, validate_engine

    monkeypatch.setenv("LILY_BACKEND", "sim")
    monkeypatch.setenv("LILY_TUNE", "off")
    monkeypatch.setenv("LILY_TRIAL_OPS", "attention_decode")  # the user's
    monkeypatch.setattr(Engines, "_user_trials", None)
    validate_engine("lily-trial:attention_decode_long+attention_prefill")
    assert trial_ops("lily-trial:attention_decode_long+attention_prefill") == ("attention_decode_long",
                                                                               "attention_prefill")
    assert is_lily("lily-trial:attention_prefill") and trial_ops("lily") == ()
    with pytest.raises(ValueError, match="not a trial kernel"):
        validate_engine("lily-trial:moe_router")
    model, _ = load_model(None, "tiny", log=None)
    engines = Engines(model)
    engines.use("lily-trial:attention_prefill")
    assert os.environ["LILY_TRIAL_OPS"] == "attention_prefill" and lily_mlx.is_patched(model)
    engines.use("lily")
    assert os.environ["LILY_TRIAL_OPS"] == "attention_decode"
    engines.use("stock")
    assert not lily_mlx.is_patched(model)


def test_decode_ab_drivers_each_get_a_column_and_advance_their_cache(monkeypatch):
    """``--drivers``: one column per (engine, driver), every column timed every turn (``generate-step``: MLX-LM's
    own loop on the column's cache; ``stream``: the bursts inside MLX-LM's generation stream; ``copy``: that loop from
    a fresh copy; ``e2e``: the e2e harness's decode from a fresh copy); an unknown driver is refused."""
    import pytest

    monkeypatch.setenv("LILY_BACKEND", "sim")
    monkeypatch.setenv("LILY_TUNE", "off")
    model, _ = load_model(None, "tiny", log=None)
    vocab = model.args.text_config["vocab_size"]
    result = decode_ab.run(model, ["lily", "stock"], context=24, bursts=2, burst_steps=3, vocab=vocab,
                           log=lambda line: None, drivers=decode_ab.DRIVERS)
    assert list(result["engines"]) == [f"{e}@{d}" for e in ("lily", "stock") for d in decode_ab.DRIVERS]
    for r in result["engines"].values():
        assert len(r["tok_s_bursts"]) == 2 and min(r["tok_s_bursts"]) > 0
    assert "| stock@generate-step |" in decode_ab.table_markdown(result)
    start, end = result["host_build_us_per_1000_ops"]  # the host's speed at the start and the end of the run
    assert start > 0 and end > 0 and f"(host: {start:.0f} / {end:.0f} us" in decode_ab.table_markdown(result)
    with pytest.raises(ValueError, match="unknown decode driver"):
        decode_ab.run(model, ["lily"], context=8, bursts=1, burst_steps=1, vocab=vocab, drivers=("eager",))


def test_decode_ab_over_a_quantized_kv_cache(monkeypatch):
    """``--kv-bits``: every engine decodes from its own copy of one quantised cache (the clones hold their own
    packed arrays: a write into one copy's rows leaves the others alone), the quantized attention kernel runs for
    lily on the simulator, and the table says which cache."""
    from mlx_lm.models.cache import QuantizedKVCache

    from bench.decode_profile import clone_cache
    from lily_mlx.core.kernel_registry import record_launches

    monkeypatch.setenv("LILY_BACKEND", "sim")
    monkeypatch.setenv("LILY_TUNE", "off")
    model, _ = load_model(None, "tiny", log=None)
    with record_launches() as launches:
        result = decode_ab.run(model, ["lily", "stock"], context=24, bursts=2, burst_steps=2,
                               vocab=model.args.text_config["vocab_size"], log=lambda _: None, kv_bits=4)
    assert "attention_decode_block_partials_live_quantized" in launches.names()  # (kv_write_in_trace's form)
    assert result["kv_bits"] == 4 and "over a 4-bit KV cache" in decode_ab.table_markdown(result)
    from bench.decode_profile import _prefill
    _, cache = _prefill(model, 8, model.args.text_config["vocab_size"], 0)
    quantized = [c for c in decode_ab.quantize_kv_caches(cache, 4) if isinstance(c, QuantizedKVCache)]
    copy = clone_cache(quantized)[0]
    assert all(a is not b for a, b in zip(copy.keys, quantized[0].keys))


def test_decode_ab_over_a_servers_batch(monkeypatch):
    """``--batch-contexts``: rows prefilled alone and merged into MLX-LM's batch caches (the attention layers'
    ``BatchKVCache`` left-padded to the longest row), every engine decodes one token a row a step from its own copy,
    lily's attention through the split over the rows' own blocks, and the rate counts every row's tokens. The batch's
    logits are each row's alone (bit for bit on the simulator today; a tolerance, since MLX's quantised matmuls promise
    no batch invariance)."""
    import mlx.core as mx
    import pytest
    from mlx_lm.models.cache import BatchKVCache

    from bench.decode_profile import _prefill
    from lily_mlx.core.kernel_registry import record_launches
    from tests.ops.deltanet_cases import rel_l2

    monkeypatch.setenv("LILY_BACKEND", "sim")
    monkeypatch.setenv("LILY_TUNE", "off")
    model, _ = load_model(None, "tiny", log=None)
    vocab = model.args.text_config["vocab_size"]
    contexts = (30, 9, 17)
    lily_mlx.patch(model)
    try:
        y, cache = decode_ab.batch_prefill(model, contexts, vocab, seed=3)
        batch_caches = [c for c in cache if type(c) is BatchKVCache]
        assert batch_caches and batch_caches[0].left_padding.tolist() == [0, 21, 13] and y.shape == (3,)
        with record_launches() as rec:
            batch_logits = model(y[:, None], cache=cache)[:, -1]
        assert "attention_decode_block_partials_rows" in rec.names()
        for i, n in enumerate(contexts):
            y1, cache1 = _prefill(model, n, vocab, 3 + i)
            alone = model(y1[:, None], cache=cache1)[:, -1]
            assert rel_l2(batch_logits[i:i + 1].astype(mx.float32), alone.astype(mx.float32)) < 2e-2, i
    finally:
        lily_mlx.unpatch(model)
    result = decode_ab.run(model, ["lily", "stock"], context=0, bursts=2, burst_steps=2, vocab=vocab,
                           log=lambda line: None, batch_contexts=contexts)
    assert result["batch_contexts"] == list(contexts) and result["context"] == 30
    for r in result["engines"].values():
        assert len(r["tok_s_bursts"]) == 2 and min(r["tok_s_bursts"]) > 0
    assert "a batch of 3 rows at contexts 30, 9, 17" in decode_ab.table_markdown(result)
    with pytest.raises(ValueError, match="bursts driver over plain caches"):
        decode_ab.run(model, ["lily"], context=0, bursts=1, burst_steps=1, vocab=vocab, batch_contexts=(8, 4),
                      kv_bits=4)
