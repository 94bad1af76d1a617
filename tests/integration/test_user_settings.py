"""A user's settings never break stock MLX-LM, and a bad one is one clear line before any model loads.

Real subprocesses of MLX-LM's CLIs (``mlx_lm.generate``, ``mlx_lm.chat``, ``mlx_lm.server``) with
lily-mlx's hook installed, as a user runs them; the in-process API (``load``, ``patch``) too.
Also: quantized KV caches (``--kv-bits``), ``mlx_lm.chat --lily``, the switches table, where the
log lines go, and whom a warning points at.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request

import pytest

import lily_mlx
from lily_mlx.patch import FALLBACK_ONLY
from lily_mlx.core.environment import LilyConfigError

from .conftest import free_port, generated_text, mlx_lm_command, subprocess_env

PROMPT = "Return the number of"
BAD_SWITCH_ENV = [("LILY_DISABLE", "foo"), ("LILY_ENABLE", "bar"), ("LILY_DISABLE", "GPU_Routing")]
BAD_ENV = BAD_SWITCH_ENV + [("LILY_BACKEND", "bogus"), ("LILY_BACKEND", "metal"),
                            ("LILY_REFERENCE_OPS", "moee"), ("LILY_ALLOW_UNTESTED", "yes"),
                            ("LILY_TUNE", "maybe"), ("LILY_CUDA_SGM_LAYOUT", "on"),
                            ("LILY_CUDA_BODY_IN_HEADER", "yes")]
MISSING_MODEL = "/nonexistent/lily-test-model"  # loading it would fail differently


def run(cmd, tmp_path, timeout=180, input=None, **env):
    full = subprocess_env()
    full.update(env)
    return subprocess.run(cmd, capture_output=True, text=True, env=full, cwd=tmp_path, timeout=timeout,
                          input=input)


def generate_cmd(model_path, *extra):
    return mlx_lm_command("generate") + ["--model", str(model_path), "--prompt", PROMPT,
                                         "--max-tokens", "24", "--ignore-chat-template", *extra]


@pytest.fixture(scope="module")
def stock_text(installed_hook, model_path, tmp_path_factory):
    proc = run(generate_cmd(model_path), tmp_path_factory.mktemp("stock"))
    assert proc.returncode == 0, proc.stderr
    return generated_text(proc.stdout)


# --- 1. bad values never break stock --------------------------------------------------------------

@pytest.mark.parametrize("var,value", BAD_SWITCH_ENV)
def test_bad_switch_names_do_not_break_importing_mlx_lm(installed_hook, tmp_path, var, value):
    proc = run([sys.executable, "-c", "import mlx_lm, mlx_lm.generate, mlx_lm.server; print('ok')"],
               tmp_path, **{var: value})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert proc.stderr == ""


@pytest.mark.parametrize("var,value", BAD_ENV)
def test_bad_values_without_lily_run_stock_with_at_most_one_warning_line(
        installed_hook, model_path, tmp_path, stock_text, var, value):
    proc = run(generate_cmd(model_path), tmp_path, **{var: value})
    assert proc.returncode == 0, proc.stderr
    assert generated_text(proc.stdout) == stock_text
    lily_lines = [line for line in proc.stderr.splitlines() if "lily" in line.lower()]
    assert len(lily_lines) == 1 and value in lily_lines[0] and "Traceback" not in proc.stderr


# --- 2. with --lily: one line, exit 2, before the model loads -----------------------------------

def _one_line_error(proc, value):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and value in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("var,value", BAD_ENV)
def test_bad_values_with_lily_are_one_line_errors_before_loading(installed_hook, tmp_path, var, value):
    """The model path does not exist: reaching the loader would fail with another error."""
    cmd = generate_cmd(MISSING_MODEL, "--lily")
    _one_line_error(run(cmd, tmp_path, **{var: value}), value)


def test_chat_with_a_bad_backend_is_a_one_line_error(installed_hook, tmp_path):
    cmd = mlx_lm_command("chat") + ["--model", MISSING_MODEL, "--lily"]
    _one_line_error(run(cmd, tmp_path, input="q\n", LILY_BACKEND="bogus"), "bogus")


def test_server_with_a_bad_backend_refuses_to_start(installed_hook, tmp_path):
    port = free_port()
    cmd = mlx_lm_command("server") + ["--model", MISSING_MODEL, "--port", str(port), "--lily"]
    _one_line_error(run(cmd, tmp_path, timeout=60, LILY_BACKEND="bogus"), "bogus")


def test_a_switch_both_disabled_and_enabled_is_an_error(installed_hook, tmp_path, monkeypatch):
    """Both in the environment, or both as flags: said, not silently on."""
    from lily_mlx.core import switches

    monkeypatch.setenv("LILY_DISABLE", "gpu_routing")
    monkeypatch.setenv("LILY_ENABLE", "gpu_routing")
    assert any("both name gpu_routing" in p for p in switches.environment_problems())
    done = run(generate_cmd(MISSING_MODEL, "--lily", "--lily-disable", "register_scan", "--lily-enable",
                            "register_scan"), tmp_path)
    assert done.returncode == 2 and "both name register_scan" in done.stderr


def test_backend_and_tune_values_in_any_case(installed_hook, model_path, tmp_path):
    """LILY_BACKEND was read in any case; --lily-backend and LILY_TUNE now are too."""
    done = run(generate_cmd(model_path, "--lily", "--lily-backend", "REFERENCE"), tmp_path, LILY_TUNE="OFF")
    assert done.returncode == 0, done.stderr
    assert "backend reference" in done.stderr and "tune profile: off" in done.stderr


@pytest.mark.parametrize("cli", ["server", "generate"])
def test_an_unsupported_model_is_refused_before_loading(installed_hook, tmp_path, cli):
    """--lily reads the model's config before loading it: the server refuses to start (it would start and then fail
    every request), generate says so at once. The folder has a config and no weights: nothing loads."""
    folder = tmp_path / "llama-model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "mistral"}')  # MLX-LM builds it as llama
    extra = ["--port", str(free_port())] if cli == "server" else ["--prompt", "hi"]
    done = run(mlx_lm_command(cli) + ["--model", str(folder), "--lily", *extra], tmp_path, timeout=60)
    _one_line_error(done, "does not support model type 'mistral' (architecture 'llama')")
    assert "run without --lily" in done.stderr


def test_unsupported_model_message_reads_only_what_is_here(tmp_path):
    from lily_mlx.patch import unsupported_model_message

    assert unsupported_model_message("no-such-org/no-such-model-anywhere") is None  # not cached: the loader decides
    assert unsupported_model_message(str(tmp_path)) is None  # no config
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5_moe"}')
    assert unsupported_model_message(str(tmp_path)) is None
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    assert "'qwen3'" in unsupported_model_message(str(tmp_path))
    # MLX-LM's (model type, architecture) remapping comes first, as its loader applies it
    (tmp_path / "config.json").write_text('{"model_type": "bailing_hybrid", "architectures": ["BailingMoeV3ForCausalLM"]}')
    assert "architecture 'bailing_moe_v3'" in unsupported_model_message(str(tmp_path))


def test_patch_refuses_what_is_not_a_model():
    with pytest.raises(TypeError, match="takes an MLX-LM model"):
        lily_mlx.patch("hello")
    assert not lily_mlx.is_patched(None)


@pytest.mark.parametrize("var,value", BAD_ENV)
def test_load_and_patch_refuse_bad_values_before_loading(monkeypatch, loaded_model, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(LilyConfigError, match=re.escape(value)):
        lily_mlx.load(MISSING_MODEL)
    model, _ = loaded_model
    with pytest.raises(LilyConfigError):
        lily_mlx.patch(model)
    assert not lily_mlx.is_patched(model)


# --- 3. quantized KV caches ----------------------------------------------------------------------

KV_FLAGS = ("--kv-bits", "4", "--quantized-kv-start", "0")


@pytest.mark.parametrize("backend", ["reference", "sim"])
def test_quantized_kv_cache_generates(installed_hook, model_path, tmp_path, backend):
    """Reference backend: stock's tokens exactly. Simulator: the decode steps attend over the quantized
    caches with the quantized kernel (no fallback line; its numbers: tests/kernels/test_attention_quantized_kv.py)
    and generation completes."""
    stock = run(generate_cmd(model_path, *KV_FLAGS), tmp_path)
    lily = run(generate_cmd(model_path, *KV_FLAGS, "--lily"), tmp_path, LILY_BACKEND=backend)
    assert stock.returncode == 0, stock.stderr
    assert lily.returncode == 0, lily.stderr
    if backend == "reference":
        assert generated_text(lily.stdout) == generated_text(stock.stdout)
    else:
        assert "quantized KV cache, using the reference" not in lily.stderr
        assert "using the reference" not in lily.stderr, lily.stderr
        assert generated_text(lily.stdout).strip()


def _start_server(model_path, tmp_path, *extra):
    port = free_port()
    log = open(tmp_path / f"server-{port}.log", "w")
    proc = subprocess.Popen(mlx_lm_command("server") + ["--model", str(model_path), "--port", str(port), *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=subprocess_env(), cwd=tmp_path)
    deadline = time.time() + 120
    while time.time() < deadline:
        assert proc.poll() is None, (tmp_path / f"server-{port}.log").read_text()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc, port
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise TimeoutError("server did not start")


@pytest.mark.slow
def test_server_with_quantized_kv_cache_answers_like_stock(installed_hook, model_path, tmp_path):
    openai = pytest.importorskip("openai", reason="the openai client is in the test extras")
    answers = {}
    for name, extra in (("stock", ()), ("lily", ("--lily",))):
        proc, port = _start_server(model_path, tmp_path, *KV_FLAGS, *extra)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                   timeout=120)
            reply = client.completions.create(model="default_model", prompt=PROMPT, max_tokens=24,
                                              temperature=0.0)
            answers[name] = reply.choices[0].text
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert answers["lily"] == answers["stock"] and answers["stock"]


# --- 8. chat, the switches table, log placement, warnings ---------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]|[\x01\x02]")


def _chat_transcript(proc) -> str:
    """The chat screen without colours and without the timing line."""
    lines = _ANSI.sub("", proc.stdout).splitlines()
    return "\n".join(line for line in lines if "tok/s" not in line)


def test_mlx_lm_chat_lily_answers_like_stock(installed_hook, model_path, tmp_path):
    cmd = mlx_lm_command("chat") + ["--model", str(model_path), "--max-tokens", "16"]
    stock = run(cmd, tmp_path, input=f"{PROMPT}\nq\n")
    lily = run(cmd + ["--lily"], tmp_path, input=f"{PROMPT}\nq\n")
    assert stock.returncode == 0 and lily.returncode == 0, lily.stderr
    assert "model patched" in lily.stderr and "model patched" not in stock.stderr
    assert _chat_transcript(lily) == _chat_transcript(stock)
    assert "bye" in _chat_transcript(lily)


def test_switches_without_kernels_say_so(tmp_path):
    proc = run([sys.executable, "-m", "lily_mlx", "switches"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line and line.split()[0] in
            lily_mlx.switches.SWITCHES}
    without = set()  # every switch acts somewhere now (fused_qk_prep: a simulator kernel since 2026-12-01)
    for name, row in rows.items():
        assert ("no kernel yet" in row) == (name in without), row
    assert "trial kernel only (LILY_TRIAL_OPS=linear_gemv)" in rows["dense_gemv"]


def test_lily_log_lines_come_before_the_generated_text(installed_hook, model_path, tmp_path):
    """stderr and stdout merged as a terminal shows them: no lily line inside the text."""
    env = subprocess_env()
    env["LILY_BACKEND"] = "sim"
    proc = subprocess.run(generate_cmd(model_path, "--lily"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout
    before, text, _ = proc.stdout.split("==========\n", 2)
    assert "[lily_mlx]" in before and "model patched" in before
    assert "[lily_mlx]" not in text


def test_unsupported_model_warning_points_at_the_caller():
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1,
                                        intermediate_size=64, num_attention_heads=2, rms_norm_eps=1e-5,
                                        vocab_size=32, num_key_value_heads=2))
    with pytest.warns(UserWarning, match="does not support model type") as record:
        lily_mlx.patch(model, strict=False)
    assert record[0].filename == __file__


def test_patch_report_names_each_op_backend_and_why_reference(loaded_model, monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", "sim")
    monkeypatch.setenv("LILY_REFERENCE_OPS", "moe_routing")
    model, _ = loaded_model
    try:
        report = lily_mlx.patch(model)._lily_report
        assert lily_mlx.patch_report(model) is report and report.backend == "sim"
        assert report.op_backends["deltanet_scan"] == "sim"
        assert report.reference_reasons["moe_expert_up"] == FALLBACK_ONLY
        assert "moe_expert_up" not in report.summary()  # stock's own path by design: not listed as missing
        assert report.op_backends["attention_qk_prep"] == "sim"
        assert report.reference_reasons["moe_routing"] == "LILY_REFERENCE_OPS"
        assert "deltanet_scan" not in report.reference_reasons
        assert report.layers == {"Qwen3NextSparseMoeBlock": 4, "Qwen3NextAttention": 1, "GatedDeltaNet": 3,
                                 "DecoderLayer": 4, "QuantizedLinear": 40,  # 3 x 5 + 4 projections, 4 x 5 in the MoE
                                 "TextModel": 1}  # blocks, lm_head; the text model (its decode step: step_trace)
        assert "reference path:" in report.summary()
    finally:
        lily_mlx.unpatch(model)
    assert lily_mlx.patch_report(model) is None
