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
