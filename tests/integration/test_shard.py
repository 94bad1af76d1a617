"""model.shard() with real mx.distributed: 2 processes on localhost over MLX's ring backend."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import free_port, subprocess_env

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
