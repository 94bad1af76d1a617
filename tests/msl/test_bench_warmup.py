"""The e2e harness's long-context warm-up: the decode kernels used only from the long-context threshold
(fixed-block attention) are compiled in an untimed step, not in the first timed token of a long prompt
(on a fresh GPU machine that compile landed inside the 32K prefill's time)."""

import pytest

from bench import e2e
from bench.model_setup import build_random_model, model_config
from lily_dev.moe_testing import simulator_problem
from lily_mlx.core.kernel_registry import record_launches
from lily_mlx.ops.attention.kernels import FIXED_BLOCK_MIN_CONTEXT


@pytest.fixture(scope="module")
def model():
    config = model_config("tiny", num_layers=4)
    config["text_config"]["head_dim"] = 256  # Qwen3.6's attention head: the fixed blocks' shape rule
    return build_random_model(config, log=None)


@pytest.mark.skipif(simulator_problem() is not None, reason="no C++ compiler for the simulator")
def test_long_lengths_warm_the_fixed_block_kernels_per_lily_engine(model, monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", "sim")
    lines = []
    with record_launches() as rec:
        e2e.warm_long_context(model, ["stock", "lily", "lily-off:gqa_packing"], [4096, FIXED_BLOCK_MIN_CONTEXT],
                              log=lines.append)
    names = rec.names()
    assert names.count("attention_decode_block_partials") == 2 and names.count("attention_decode_merge_blocks") == 2
    assert sorted({launch.template["GT"] for launch in rec if launch.name == "attention_decode_block_partials"}) == [1, 8]
    assert len(lines) == 2 and "lily-off:gqa_packing" in lines[1]
    import lily_mlx

    assert not lily_mlx.is_patched(model)  # the harness leaves the model stock


def test_short_lengths_warm_nothing(model):
    lines = []
    with record_launches() as rec:
        e2e.warm_long_context(model, ["lily"], [512, FIXED_BLOCK_MIN_CONTEXT - 1], log=lines.append)
    assert not rec.names() and not lines


def _chunk_sizes(model, length: int, step: int) -> set:
    """The prompt chunk lengths MLX-LM's generate_step feeds the model for a prompt of ``length`` tokens (its
    prefill loop, then the first decode step), recorded at the model's call."""
    import mlx.core as mx

    seen = []
    real = type(model).__call__

    class Recording(type(model)):
        def __call__(self, inputs, *args, **kwargs):
            seen.append(inputs.shape[1])
            return real(self, inputs, *args, **kwargs)

    stock_class = type(model)
    model.__class__ = Recording
    try:
        e2e.run_once(model, mx.arange(length) % 100, 0, step)
    finally:
        model.__class__ = stock_class
    return set(seen)


def test_the_chunk_warmup_prefills_every_chunk_size_of_the_timed_lengths(model):
    """Each warm-up length is prefilled as one chunk, and together they prefill every chunk size the timed lengths'
    prompts are cut into (so round 1 of a length does not compile lily's per-chunk-size kernel variants)."""
    step, timed = 16, [10, 16, 17, 40, 64]
    warm = e2e.chunk_warmup_lengths(timed, step, first=8)
    assert 8 in warm
    timed_chunks = set().union(*(_chunk_sizes(model, n, step) for n in timed))
    warm_chunks = {n: _chunk_sizes(model, n, step) for n in warm}
    assert all(len(chunks - {1}) <= 1 for chunks in warm_chunks.values()), warm_chunks  # one prefill chunk each
    assert timed_chunks <= set().union(*warm_chunks.values()), (timed_chunks, warm_chunks)
