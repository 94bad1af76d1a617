"""``bench.kernels.record_kernel_calls`` (``bench.run --mode kernels``): the launches of one prefill chunk and one
decode step of the patched tiny model, recorded from steps built op by op (a decode step traced on a GPU
backend would hand the record the trace's placeholder arrays, which cannot be evaluated: the kernels mode
failed so on the H200), with inputs that evaluate; the model is left unpatched."""

import contextlib

import mlx.core as mx

import lily_mlx
from bench import kernels
from bench.model_setup import load_model
from lily_mlx.core import kernel_registry, switches


def test_kernel_calls_are_recorded_from_steps_built_op_by_op(monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", "sim")
    monkeypatch.setenv("LILY_TUNE", "off")
    real = kernel_registry.record_launches
    traced_while_recording = []

    @contextlib.contextmanager
    def watched():
        traced_while_recording.append(switches.is_enabled("compiled_decode"))
        with real() as record:
            yield record

    monkeypatch.setattr(kernel_registry, "record_launches", watched)
    model, _ = load_model(None, "tiny", log=None)
    calls = kernels.record_kernel_calls(model, 8, model.args.text_config["vocab_size"], log=None)
    assert traced_while_recording == [False, False]
    assert {phase for phase, _, _, _ in calls} == {"prefill", "decode"}
    mx.eval([kw["inputs"] for _, _, _, kw in calls])
    assert switches.is_enabled("compiled_decode") and not lily_mlx.is_patched(model)


def test_a_decode_gemv_is_counted_for_the_experts_a_token_reads():
    """The kernels mode's bytes: a decode GEMV reads top_k of a stacked [E, ...] expert array, every other call (and
    2-D arrays such as the shared expert's) all of each input; outputs once. Hand-counted bytes."""
    kwargs = {"inputs": [mx.zeros((1, 64), mx.bfloat16),  # 128 B: the token
                         mx.zeros((16, 32, 8), mx.uint32),  # 16,384 B: 16 experts' packed weights
                         mx.zeros((16, 32, 1), mx.bfloat16),  # 1,024 B: their scales
                         mx.zeros((32, 8), mx.uint32)],  # 1,024 B: the shared expert's weights
              "output_shapes": [(2, 32)], "output_dtypes": [mx.bfloat16]}  # 128 B
    assert kernels.bytes_read("decode", "moe_gemv_gate_up_swiglu_routed", kwargs, top_k=4) == (
        128 + 16384 // 4 + 1024 // 4 + 1024 + 128)
    whole = 128 + 16384 + 1024 + 1024 + 128
    assert kernels.bytes_read("prefill", "moe_gemm_gate_up_swiglu_regtile", kwargs, top_k=4) == whole
    assert kernels.bytes_read("decode", "attention_qk_prep", kwargs, top_k=4) == whole
    assert kernels.bytes_read("decode", "moe_gemv_gate_up_swiglu_routed", kwargs) == whole  # top_k unknown


def test_the_tiny_models_routed_decode_gemv_reads_a_fraction_of_its_expert_stacks(monkeypatch):
    """On the recorded launches: the routed gate+up GEMV of a decode step is handed whole expert stacks, and is
    counted for top_k of them (the tiny model's 4 of its experts)."""
    monkeypatch.setenv("LILY_BACKEND", "sim")
    monkeypatch.setenv("LILY_TUNE", "off")
    model, _ = load_model(None, "tiny", log=None)
    config = model.args.text_config
    calls = kernels.record_kernel_calls(model, 8, config["vocab_size"], log=None)
    routed = [kw for phase, name, _, kw in calls if phase == "decode" and name == "moe_gemv_gate_up_swiglu_routed"]
    assert routed, sorted({name for phase, name, _, _ in calls if phase == "decode"})
    stacks = [a for a in routed[0]["inputs"] if isinstance(a, mx.array) and a.ndim == 3
              and a.shape[0] == config["num_experts"]]
    assert stacks  # gate and up weights, scales, biases
    counted = kernels.bytes_read("decode", "moe_gemv_gate_up_swiglu_routed", routed[0],
                                 top_k=config["num_experts_per_tok"])
    whole = kernels.bytes_read("decode", "moe_gemv_gate_up_swiglu_routed", routed[0])
    assert whole - counted == sum(a.nbytes - a.nbytes * config["num_experts_per_tok"] // a.shape[0] for a in stacks)
