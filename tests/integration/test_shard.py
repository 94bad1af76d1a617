"""model.shard() with real mx.distributed: 2 processes on localhost over MLX's ring backend."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import free_port, mlx_lm_command, subprocess_env

WORKER = Path(__file__).with_name("shard_worker.py")


def launch_command():
    script = Path(sys.executable).parent / "mlx.launch"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c",
            "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]


@pytest.mark.slow  # ~30 s: the CPU ring pays ~30 ms per all-reduce
def test_tensor_parallel_two_ranks(random_model, tmp_path):
    pytest.importorskip("mlx._distributed_utils.launch", reason="this MLX has no mlx.launch")
    # The random checkpoint keeps whole 64-wide quantisation groups on each of 2 ranks.
    model_dir = random_model("qwen3_5_moe")
    out = tmp_path / "result.json"
    rank_files = [Path(f"{out}.rank{r}") for r in range(2)]
    env = subprocess_env()
    repo_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = repo_root  # the workers use the lily_mlx under test
    for attempt in range(2):  # a second try on fresh ports if another process took ours
        cmd = launch_command() + ["--backend", "ring", "-n", "2", "--starting-port",
                                  str(free_port()), "--", sys.executable, str(WORKER),
                                  str(model_dir), str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240,
                              cwd=tmp_path)
        if proc.returncode == 0:
            break
    assert proc.returncode == 0 and all(f.exists() for f in rank_files), (
        f"ranks failed:\n{proc.stdout}\n{proc.stderr}")
    result, other = (json.loads(f.read_text()) for f in rank_files)

    assert result["size"] == 2
    # the ring really split the model: each rank holds half the heads (KV heads repeated if needed)
    assert result["heads"] == {"deltanet_v_heads": 2, "deltanet_k_heads": 1,
                               "attention_heads": 8, "attention_kv_heads": 1}
    assert len(result["stock"]) == 12
    assert result["lily_after_shard"] == result["stock"]
    assert result["stock_again"] == result["stock"]
    assert result["lily_before_shard"] == result["stock"]
    assert result["patched"]
    # the sharded model all-reduces, so both ranks produce the same tokens
    for key in ("stock", "lily_after_shard", "stock_again", "lily_before_shard"):
        assert other[key] == result[key], key


@pytest.mark.slow  # ~1 min: two simulator processes over the CPU ring
def test_tensor_parallel_two_ranks_with_kernels(random_model, tmp_path):
    """lily's kernels (simulator) on a model sharded over 2 real ranks: the DeltaNet and MoE kernels run
    on their rank's slices (heads, experts' width, the shared expert), and the sharded logits match sharded
    stock's and the single-process lily's as closely as sharded stock matches single-process stock
    (the all-reduce of bf16 partials is the only new rounding)."""
    pytest.importorskip("mlx._distributed_utils.launch", reason="this MLX has no mlx.launch")
    from lily_dev.moe_testing import simulator_problem
    from mlx_lm.utils import load_model

    from lily_mlx.consistency import teacher_forced_logits
    from tests.integration.shard_kernels_worker import CONTINUATION, PROMPT

    if simulator_problem() is not None:
        pytest.skip(f"no C++ compiler for the simulator: {simulator_problem()}")
    import mlx.core as mx
    import numpy as np

    import lily_mlx

    model_dir = random_model("qwen3_5_moe")
    out = tmp_path / "logits"
    env = subprocess_env()
    env["LILY_BACKEND"] = "sim"
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    worker = Path(__file__).with_name("shard_kernels_worker.py")
    for attempt in range(2):  # a second try on fresh ports if another process took ours
        cmd = launch_command() + ["--backend", "ring", "-n", "2", "--starting-port", str(free_port()), "--",
                                  sys.executable, str(worker), str(model_dir), str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400, cwd=tmp_path)
        if proc.returncode == 0:
            break
    ranks = [np.load(f"{out}.rank{r}.npz") for r in range(2)]
    assert proc.returncode == 0, f"ranks failed:\n{proc.stdout}\n{proc.stderr}"
    launched = set(json.loads(str(ranks[0]["launched"])))
    # (This checkpoint's attention head dim, 32, is outside the decode attention kernel's: stock's there.)
    # (decode: the gate/up GEMV selects the experts itself, fused_topk_gemv; prefill: the top-k kernel, GEMMs)
    assert {"moe_router_topk_from_logits", "moe_gemv_gate_up_swiglu_routed", "moe_gemm_gate_up_swiglu_regtile",
            "deltanet_scan_staged", "deltanet_decode_conv_fused"} <= launched, launched

    model, _ = load_model(Path(model_dir), lazy=False, strict=False)
    prompt = mx.array(PROMPT)
    single_stock = np.asarray(teacher_forced_logits(model, prompt, CONTINUATION))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LILY_BACKEND", "sim")
        lily_mlx.patch(model)
        try:
            single_lily = np.asarray(teacher_forced_logits(model, prompt, CONTINUATION))
        finally:
            lily_mlx.unpatch(model)

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    sharded_stock, sharded_lily = ranks[0]["stock"], ranks[0]["lily"]
    assert np.array_equal(ranks[1]["lily"], sharded_lily)  # the all-reduce gives both ranks the same
    noise = max(rel(sharded_stock, single_stock), rel(single_lily, single_stock), 1e-3)
    assert rel(sharded_lily, sharded_stock) <= 3 * noise, (rel(sharded_lily, sharded_stock), noise)
    assert rel(sharded_lily, single_lily) <= 3 * noise, (rel(sharded_lily, single_lily), noise)


def test_shard_benchmark_two_ranks(tmp_path):
    """bench/shard.py (the 2-GPU benchmark) on 2 CPU ranks over the ring, reference backend: the model is
    sharded, lily's greedy tokens equal stock's in the check and in every timed run, and rank 0's
    results.json records world size 2."""
    pytest.importorskip("mlx._distributed_utils.launch", reason="this MLX has no mlx.launch")
    env = subprocess_env()  # LILY_BACKEND=reference
    repo_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = repo_root
    out = tmp_path / "out"
    for attempt in range(2):  # a second try on fresh ports if another process took ours
        cmd = launch_command() + ["--backend", "ring", "-n", "2", "--starting-port", str(free_port()), "--",
                                  sys.executable, "-m", "bench.shard", "--backend", "ring", "--size", "tiny",
                                  "--lengths", "48", "--gen-tokens", "3", "--rounds", "1", "--engines", "stock,lily",
                                  "--warmup-length", "0", "--check-prompt", "16", "--check-steps", "2",
                                  "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
        if proc.returncode == 0:
            break
    assert proc.returncode == 0, f"ranks failed:\n{proc.stdout}\n{proc.stderr}"
    result = json.loads((out / "results.json").read_text())
    assert result["world_size"] == 2 and result["backend"] == "ring"
    assert result["same_weights_on_ranks"]
    check = result["check"]
    assert check["same_tokens"] and check["agrees"] and check["fp32_lily_vs_stock"] == 0.0, check
    assert check["layers"] == 4  # a short model of the same widths (rounding stays judgeable)
    (row,) = result["e2e"]["rows"]
    assert result["e2e"]["complete"] and row["length"] == 48
    assert len(row["lily"]["tokens"]) == 4 and row["lily"]["tokens"] == row["stock"]["tokens"]
    assert row["lily"]["prompt_tps"] > 0 and row["lily"]["generation_tps"] > 0
    assert (out / "shard.md").exists() and (out / "check_logits.npz").exists()


@pytest.mark.slow  # ~20 s: two 2-rank servers on the CPU ring
def test_sharded_server_lily_answers_like_sharded_stock(random_model, tmp_path):
    """``mlx.launch --backend ring -n 2 -- mlx_lm.server --lily`` (docs/usage.md): both ranks load with
    MLX-LM's sharded_load and patch; rank 0 answers temperature-0 chat requests with the completions of
    the sharded stock server (reference backend: the same tokens), through bench/serve_check.py."""
    pytest.importorskip("mlx._distributed_utils.launch", reason="this MLX has no mlx.launch")
    model_dir = random_model("qwen3_5_moe")
    env = subprocess_env()
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])  # bench/ and the lily_mlx under test
    env["LILY_BACKEND"] = "reference"
    results = {}
    for engine in ("lily", "stock"):
        out = tmp_path / f"{engine}.json"
        server = mlx_lm_command("server") + ["--model", str(model_dir), "--port", str(free_port())]
        cmd = ([sys.executable, "-m", "bench.serve_check", "--max-tokens", "12", "--ready-timeout", "150",
                "--out", str(out), "--"] + launch_command()
               + ["--backend", "ring", "-n", "2", "--starting-port", str(free_port()), "--"]
               + server + (["--lily"] if engine == "lily" else []))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
        log = out.with_suffix(".log").read_text() if out.with_suffix(".log").exists() else ""
        assert proc.returncode == 0, f"{engine} server failed:\n{proc.stderr}\n{log}"
        results[engine] = json.loads(out.read_text())
        if engine == "lily":
            assert log.count("model patched") == 2, log  # one line per rank
    texts = {e: [a["text"] for a in r["answers"]] for e, r in results.items()}
    assert len(texts["lily"]) == 2 and all(texts["lily"]), texts
    assert texts["lily"] == texts["stock"]
