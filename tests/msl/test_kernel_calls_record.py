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
