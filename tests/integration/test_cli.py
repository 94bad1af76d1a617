"""``mlx_lm.generate --lily`` (installed hook) and ``python -m lily_mlx``: same tokens as stock.

Real subprocesses for the installed hook (plain, --lily, one switch off, the ``mlx_lm`` dispatcher);
every other switch goes through ``python -m lily_mlx generate``'s code in this process (one model load
each, no interpreter start), compared with stock MLX-LM's own ``main`` run the same way.
"""

from __future__ import annotations

import subprocess
import sys
import types

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from lily_mlx import cli, switches

from .conftest import PROMPT, generated_text, mlx_lm_command, subprocess_env

MAX_TOKENS = "64"
PATCHED_NOTE = "model patched"


def mlx_lm_module(name):
    """``mlx_lm.<name>`` the module (``import mlx_lm.generate as m`` gives the function)."""
    import importlib

    return importlib.import_module(f"mlx_lm.{name}")


def generate_args(model_path):
    return ["--model", str(model_path), "--prompt", PROMPT, "--max-tokens", MAX_TOKENS,
            "--ignore-chat-template"]


def run_cli(cmd, tmp_path, timeout=180, **env):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(subprocess_env(), **env), cwd=tmp_path,
                          timeout=timeout)
    return proc


# ------------------------------------------------------------------------------------------------
# Installed hook: real MLX-LM CLI processes
# ------------------------------------------------------------------------------------------------


def test_pth_hook_imports_nothing_heavy(installed_hook, tmp_path):
    probe = ("import sys; print(any(getattr(f, '_lily_cli_finder', False) for f in sys.meta_path), "
             "sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'lily_mlx', "
             "'numpy', 'transformers')))")
    proc = run_cli([sys.executable, "-c", probe], tmp_path)
    assert proc.stdout.strip() == "True []", proc.stdout + proc.stderr


def test_hooked_mlx_lm_is_stock_outside_main(installed_hook, tmp_path):
    """Importing mlx_lm (which imports mlx_lm.generate) only wraps main; the module's names are
    MLX-LM's own until main runs with the lily flags."""
    probe = ("import argparse, sys, mlx_lm; g = sys.modules['mlx_lm.generate']; "
             "print(g.load is sys.modules['mlx_lm.utils'].load, g.argparse is argparse, "
             "hasattr(g.main, '_lily_original_main'))")
    proc = run_cli([sys.executable, "-c", probe], tmp_path)
    assert proc.stdout.strip().splitlines()[-1] == "True True True", proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def cli_stock_text(installed_hook, model_path, tmp_path_factory):
    """What stock ``mlx_lm.generate`` prints (a real process, no --lily)."""
    proc = run_cli(mlx_lm_command("generate") + generate_args(model_path),
                   tmp_path_factory.mktemp("cli"))
    assert proc.returncode == 0, proc.stderr
    assert PATCHED_NOTE not in proc.stderr
    text = generated_text(proc.stdout)
    assert text.strip()
    return text


@pytest.mark.parametrize("extra,note", [
    ([], "switches off: none"),
    (["--lily-disable", "gpu_routing"], "switches off: gpu_routing"),
])
def test_mlx_lm_generate_lily_prints_stock_tokens(cli_stock_text, model_path, tmp_path, extra, note):
    proc = run_cli(mlx_lm_command("generate") + generate_args(model_path) + ["--lily"] + extra,
                   tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert generated_text(proc.stdout) == cli_stock_text
    assert PATCHED_NOTE in proc.stderr and note in proc.stderr


def test_mlx_lm_dispatcher_routes_lily(cli_stock_text, model_path, tmp_path):
    proc = run_cli([sys.executable, "-m", "mlx_lm", "generate", "--lily"]
                   + generate_args(model_path), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert generated_text(proc.stdout) == cli_stock_text
    assert PATCHED_NOTE in proc.stderr


def test_unknown_switch_is_an_error_listing_valid_names(installed_hook, model_path, tmp_path):
    proc = run_cli(mlx_lm_command("generate") + generate_args(model_path)
                   + ["--lily", "--lily-disable", "gpu_routing,warp_drive"], tmp_path)
    assert proc.returncode == 2
    assert "warp_drive" in proc.stderr
    for name in switches.SWITCHES:
        assert name in proc.stderr


def test_mlx_lm_benchmark_lily_times_the_patched_model(installed_hook, model_path, tmp_path):
    """MLX-LM's own benchmark (what a Mac user times with) takes --lily too; without it, stock."""
    args = ["--model", str(model_path), "-p", "32", "-g", "8", "-n", "1"]
    lily = run_cli(mlx_lm_command("benchmark") + args + ["--lily", "--lily-disable", "gpu_routing"], tmp_path)
    assert lily.returncode == 0, lily.stderr[-2000:]
    assert PATCHED_NOTE in lily.stderr and "switches off: gpu_routing" in lily.stderr
    assert "Averages: prompt_tps=" in lily.stdout
    stock = run_cli(mlx_lm_command("benchmark") + args, tmp_path)
    assert stock.returncode == 0 and PATCHED_NOTE not in stock.stderr and "Averages: prompt_tps=" in stock.stdout


@pytest.mark.parametrize("backend", ["reference", "sim"])
def test_mlx_lm_cache_prompt_lily_writes_a_cache_stock_generates_from(installed_hook, model_path, tmp_path, backend):
    """A prompt cache file made by ``mlx_lm.cache_prompt --lily`` is stock's format: stock ``mlx_lm.generate``
    continues from it as from one stock made (reference backend: the same bits; the simulated kernels: the same
    cache classes, shapes and dtypes, states within bf16 noise of stock's)."""
    from mlx_lm.models.cache import load_prompt_cache

    prompt_head, rest = PROMPT[:24], PROMPT[24:]
    texts, caches = [], []
    for extra in ([], ["--lily"]):
        cache_file = tmp_path / f"cache{len(extra)}.safetensors"
        made = run_cli(mlx_lm_command("cache_prompt") + ["--model", str(model_path), "--prompt", prompt_head,
                                                         "--prompt-cache-file", str(cache_file)] + extra, tmp_path,
                       LILY_BACKEND=backend)
        assert made.returncode == 0 and cache_file.exists(), made.stderr[-2000:]
        assert (PATCHED_NOTE in made.stderr) == bool(extra)
        used = run_cli(mlx_lm_command("generate") + ["--model", str(model_path), "--prompt-cache-file",
                                                     str(cache_file), "--prompt", rest, "--max-tokens", "12",
                                                     "--ignore-chat-template"], tmp_path)
        assert used.returncode == 0, used.stderr[-2000:]
        texts.append(generated_text(used.stdout))
        caches.append(load_prompt_cache(str(cache_file)))
    assert texts[1].strip()
    if backend == "reference":
        assert texts[0] == texts[1]
    assert [type(c) for c in caches[0]] == [type(c) for c in caches[1]]
    for stock, lily in zip(*caches):
        stock_state, lily_state = tree_flatten(stock.state), tree_flatten(lily.state)
        assert [k for k, _ in stock_state] == [k for k, _ in lily_state]
        for (_, a), (_, b) in zip(stock_state, lily_state):
            assert type(a) is type(b)
            if not isinstance(a, mx.array):  # (an ArraysCache slot never written)
                continue
            assert (a.shape, a.dtype) == (b.shape, b.dtype)
            a, b = a.astype(mx.float32), b.astype(mx.float32)
            # relative L2 within 5e-2 (measured up to 0.020: stock's CPU matmuls sum in bf16, docs/decode.md)
            assert float(mx.sqrt(mx.sum((a - b) ** 2) / mx.maximum(mx.sum(a * a), 1e-30)).item()) < 5e-2


def test_lily_flags_in_mlx_lm_help(installed_hook, tmp_path):
    for cli in ("server", "benchmark", "cache_prompt", "perplexity"):
        proc = run_cli(mlx_lm_command(cli) + ["--help"], tmp_path)
        assert proc.returncode == 0
        for flag in ("--lily", "--lily-disable", "--lily-enable", "--lily-backend"):
            assert flag in proc.stdout, cli


# ------------------------------------------------------------------------------------------------
# python -m lily_mlx generate, in process
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def in_process(monkeypatch, capsys):
    """Run an MLX-LM CLI main in this process; returns (stdout, stderr). Restores switches/env."""
    monkeypatch.setenv("LILY_BACKEND", "reference")
    monkeypatch.delenv("LILY_DISABLE", raising=False)
    monkeypatch.delenv("LILY_ENABLE", raising=False)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    switches.reset()

    def run(fn):
        capsys.readouterr()
        with switches.overrides():
            rc = fn()
        out = capsys.readouterr()
        return rc, out.out, out.err

    yield run
    switches.reset()


@pytest.fixture(scope="module")
def stock_text(model_path):
    """What stock MLX-LM's generate ``main`` prints, run in this process."""
    import contextlib
    import io
    import os

    gen = mlx_lm_module("generate")
    saved_argv, out = sys.argv, io.StringIO()
    sys.argv = ["mlx_lm.generate", *generate_args(model_path)]
    os.environ.pop("LILY_DISABLE", None)
    try:
        with contextlib.redirect_stdout(out):
            cli.run_mlx_lm_main(gen)
    finally:
        sys.argv = saved_argv
    return generated_text(out.getvalue())


@pytest.mark.parametrize("name", [None] + list(switches.SWITCHES))
def test_lily_mlx_generate_each_switch_off(model_path, in_process, stock_text, name):
    """Reference backend: each ``--lily-disable`` leaves stock's text (and chunked_prefill the chunk
    size MLX-LM gets). That the flags reach the kernels: the next test, on the simulator."""
    gen = mlx_lm_module("generate")

    argv = ["generate", *generate_args(model_path)]
    if name:
        argv += ["--lily-disable", name]
    loaded = []
    real_load = gen.load

    def spy_load(*args, **kwargs):  # see the model the CLI ran
        out = real_load(*args, **kwargs)
        loaded.append(out[0])
        return out

    step_sizes = []
    real_generate = gen.generate

    def spy_generate(*args, **kwargs):  # see the prompt chunk size MLX-LM was given
        step_sizes.append(kwargs.get("prefill_step_size"))
        return real_generate(*args, **kwargs)

    gen.load, gen.generate = spy_load, spy_generate
    try:
        rc, out, err = in_process(lambda: cli.main(argv))
    finally:
        gen.load, gen.generate = real_load, real_generate
    assert rc == 0
    assert generated_text(out) == stock_text
    # chunked_prefill off = the whole prompt as one chunk; on = MLX-LM's default chunks
    assert step_sizes == [sys.maxsize if name == "chunked_prefill" else 2048]
    from lily_mlx import is_patched

    assert loaded and is_patched(loaded[0])
    assert gen.load is real_load and gen.argparse is cli.argparse  # MLX-LM's globals restored


def test_cli_switch_flags_reach_the_kernels(model_path, in_process, monkeypatch):
    """The test above runs on the reference backend, where no kernel switch changes anything. Here
    ``--lily-backend sim --lily-disable register_scan,fused_combine,gqa_packing``: the launch record
    shows each flag in the kernels the CLI ran (blockwise scan, no combine kernel, one query head per
    decode-attention threadgroup), and the other switches kept their kernels."""
    from lily_dev.moe_testing import simulator_problem
    from lily_mlx.core.kernel_registry import record_launches

    if simulator_problem() is not None:
        pytest.skip(f"no C++ compiler for the simulator: {simulator_problem()}")
    argv = ["generate", "--model", str(model_path), "--prompt", PROMPT, "--max-tokens", "3",
            "--ignore-chat-template", "--lily-backend", "sim",
            "--lily-disable", "register_scan,fused_combine,gqa_packing"]
    monkeypatch.delenv("LILY_BACKEND")  # restored afterwards (the flag sets it for the run)
    with record_launches() as rec:
        rc, out, err = in_process(lambda: cli.main(argv))
    assert rc == 0 and generated_text(out)
    names = set(rec.names())
    # (decode attention over the KV buffer, kv_write_in_trace: the live-length block partials)
    decode_attention = "attention_decode_block_partials_live"
    assert {"deltanet_scan_blockwise", "deltanet_decode_conv_fused", "moe_router_topk_from_logits",
            decode_attention} <= names, names
    assert names & {"moe_gemm_gate_up_swiglu_regtile", "moe_gemv_gate_up_swiglu"}, names
    assert not names & {"deltanet_scan_register", "deltanet_scan_staged", "moe_combine_weighted_rows"}, names
    assert {launch.template["GT"] for launch in rec if launch.name == decode_attention} == {1}
    assert {launch.template["COALESCED"] for launch in rec if launch.name == decode_attention} == {1}


def test_without_lily_mlx_lm_main_runs_stock(model_path, in_process):
    gen = mlx_lm_module("generate")

    from lily_mlx import is_patched

    loaded = []
    real_load = gen.load
    gen.load = lambda *a, **k: loaded.append(real_load(*a, **k)) or loaded[-1]
    try:
        sys.argv = ["mlx_lm.generate", *generate_args(model_path)]
        in_process(lambda: cli.run_mlx_lm_main(gen))
    finally:
        gen.load = real_load
    assert loaded and not is_patched(loaded[0][0])


def test_lily_mlx_help_and_usage(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("generate", "server", "switches", "embedded-model", "consistency",
                    "build-random"):
        assert command in out
    with pytest.raises(SystemExit) as done:
        cli.main(["generate", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--lily-disable" in out and "--max-tokens" in out and "lily-mlx is on" in out
    assert cli.main(["no-such-command"]) == 2


def test_switches_table(capsys, monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", "reference")
    try:
        assert cli.main(["switches", "--lily-disable", "gpu_routing"]) == 0
    finally:
        switches.reset()
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    for name, sw in switches.SWITCHES.items():
        assert rows[name][1] == ("on" if sw.default else "off")
        assert rows[name][3] == sw.phase
    assert rows["gpu_routing"][2] == "off" and rows["fused_dequant"][2] == "on"
    assert rows["gpu_routing"][5] == "reference"
    assert "backend in force: reference" in out
    from lily_mlx.ops import OPS

    for op in OPS:
        assert rows[op][3] == "reference"


def test_delegated_commands(monkeypatch, capsys):
    fake = types.ModuleType("lily_fake_tool")
    fake.main = lambda argv: 7 if argv == ["--x", "1"] else 0
    monkeypatch.setitem(sys.modules, "lily_fake_tool", fake)
    monkeypatch.setitem(cli._DELEGATED, "consistency", ("lily_fake_tool", "test"))
    assert cli.main(["consistency", "--x", "1"]) == 7
    monkeypatch.setitem(cli._DELEGATED, "build-random", ("lily_mlx.no_such_module", "test"))
    assert cli.main(["build-random"]) == 2
    assert "not available" in capsys.readouterr().err


def test_cli_loader_main_model_strict_draft_model_lenient():
    """With --lily, MLX-LM's main model must be supported (clean exit for mlx_lm.generate); a draft
    model, loaded with a bare load(path), stays stock with a warning when it is not."""
    from mlx_lm.models import llama

    from lily_mlx import is_patched

    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=1,
                           intermediate_size=64, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=64, num_key_value_heads=4)
    draft = llama.Model(args)
    session = cli._Session("mlx_lm.generate", force=True)
    session.active = True
    load = cli._patching_loader(lambda *a, **k: (draft, "tokenizer"), session)
    with pytest.warns(UserWarning, match="does not support model type 'llama'"):
        assert load("draft-path") == (draft, "tokenizer")
    assert not is_patched(draft)
    with pytest.raises(SystemExit) as done:
        load("main-path", tokenizer_config={})
    assert "qwen3_5_moe" in str(done.value.code)
