"""The sweep and the ablation table survive a device call's time limit: the sweep resumes from
results.json, refuses another sweep in the same folder, stops before a length that would not fit
(--stop-at), prefills once per round with --shared-prefill and marks what it did not measure; the
ablations cover every switch and resume the same way. Tiny model, reference backend: the numbers mean
nothing, the bookkeeping is what is tested."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from bench import ablations, e2e, estimate, run

REPO = Path(__file__).resolve().parents[2]
SWEEP = ["--mode", "e2e", "--size", "tiny", "--num-layers", "4", "--lengths", "16,24,32", "--rounds", "1",
         "--gen-tokens", "2", "--engines", "stock,lily", "--prefill-step-size", "16", "--warmup-length", "0"]


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", "reference")


def rows(out: Path):
    data = json.loads((out / "results.json").read_text())["e2e"]
    return data, {r["label"]: r for r in data["rows"]}


def test_sweep_interrupted_then_resumed(monkeypatch, tmp_path):
    real = e2e.run_once
    calls = []

    def killed_in_third_length(model, prompt, gen, step):
        calls.append(int(prompt.size))
        if prompt.size == 32:
            raise KeyboardInterrupt  # a time limit killing the process in the middle of a length
        return real(model, prompt, gen, step)

    monkeypatch.setattr(e2e, "run_once", killed_in_third_length)
    with pytest.raises(KeyboardInterrupt):
        run.main(SWEEP + ["--out", str(tmp_path)])
    data, first = rows(tmp_path)
    assert list(first) == ["16", "24"] and data["complete"] is False  # saved after every length

    calls.clear()
    monkeypatch.setattr(e2e, "run_once", lambda *a: (calls.append(int(a[1].size)), real(*a))[1])
    assert run.main(SWEEP + ["--out", str(tmp_path)]) == 0
    assert set(calls) == {32}  # only the missing length ran
    data, second = rows(tmp_path)
    assert list(second) == ["16", "24", "32"] and data["complete"] is True
    assert second["16"] == first["16"] and second["24"] == first["24"]  # kept, not re-measured
    assert "| 32 |" in (tmp_path / "e2e.md").read_text()
    assert len(json.loads((tmp_path / "results.json").read_text())["e2e_calls"]) == 2

    # Another sweep in the same folder is refused, naming what differs; --fresh starts over.
    with pytest.raises(SystemExit, match="rounds"):
        run.main([a if a != "1" else "2" for a in SWEEP] + ["--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="engines"):
        run.main([a if a != "stock,lily" else "lily" for a in SWEEP] + ["--out", str(tmp_path)])
    calls.clear()
    assert run.main(SWEEP + ["--lengths", "16", "--fresh", "--out", str(tmp_path)]) == 0
    assert set(calls) == {16} and list(rows(tmp_path)[1]) == ["16"]


def test_sweep_stops_before_a_length_that_does_not_fit(tmp_path, capsys):
    # Stop time already past: nothing runs, the table says what is missing, the plan lists it.
    assert run.main(SWEEP + ["--out", str(tmp_path), "--stop-at", str(time.time() - 1)]) == 0
    data, got = rows(tmp_path)
    assert got == {} and data["complete"] is False
    assert "Incomplete: 16, 24, 32" in (tmp_path / "e2e.md").read_text()
    capsys.readouterr()
    assert run.main(SWEEP + ["--out", str(tmp_path), "--plan"]) == 0
    plan = capsys.readouterr().out
    assert "left: 3 of 3 lengths" in plan and "call 1:" in plan

    clock = estimate.Clock(time.time() + 100)
    assert clock.fits(50) and not clock.fits(150)
    clock.record(10, 30)  # rows here take 3x their estimate
    assert clock.factor == 3.0 and not clock.fits(50)


def test_shared_prefill_and_max_prefill_length(tmp_path):
    """--shared-prefill: one prefill per round (lily) for every engine's decode; stock prefills itself only
    up to --max-prefill-length, and decodes beyond it from the shared cache; the table marks the gap."""
    argv = SWEEP + ["--shared-prefill", "--max-prefill-length", "stock=16", "--out", str(tmp_path)]
    assert run.main(argv) == 0
    _, got = rows(tmp_path)
    r16, r32 = got["16"], got["32"]
    assert r16["stock"]["prompt_tps"] > 0 and r16["shared_prefill"] == "lily"
    assert r32["stock"]["prompt_tps"] is None and r32["stock"]["not_measured"]["what"] == "prefill"
    assert r32["stock"]["generation_tps"] > 0 and r32["stock"]["peak_memory_decode_only"]
    assert r32["lily"]["prompt_tps"] > 0 and r32["lily"]["generation_tps"] > 0
    assert r32["prefill_ratio"] is None and r32["decode_ratio"] > 0
    assert r32["same_tokens"] is True  # reference backend, same cache: the same decode tokens
    table = (tmp_path / "e2e.md").read_text()
    assert "| 32 | n/m |" in table and "--max-prefill-length stock=16" in table and "*" in table


def test_shared_prefill_decodes_what_an_own_prefill_decodes():
    """Decoding from the shared cache continues the greedy sequence of an engine's own run: the shared
    cache holds the prompt and the first token, and its decode yields tokens 3, 4, ... of the run."""
    from bench.model_setup import load_model

    model, _ = load_model(None, "tiny", num_layers=4, log=None)
    own = e2e.sweep(model, [24], [24], [24], 1, 6, 16, ("stock", "lily"), 1024, log=lambda m: None)[0]
    shared = e2e.sweep(model, [24], [24], [24], 1, 6, 16, ("stock", "lily"), 1024, log=lambda m: None,
                       shared_prefill=True)[0]
    for engine in ("stock", "lily"):
        assert shared[engine]["tokens"][:4] == own[engine]["tokens"][2:6]
        assert shared[engine]["prompt_tps"] > 0 and shared[engine]["peak_memory"] > 0


def test_ablations_cover_every_switch_and_resume(tmp_path):
    from lily_mlx.core import switches

    assert {s for s, *_ in ablations.ABLATIONS} == set(switches.SWITCHES)
    lengths = {(s, n) for s, _, n, _ in ablations.ABLATIONS}
    for s, n in [("fused_dequant", 512), ("gpu_routing", 512), ("adaptive_tile", 2048), ("register_scan", 2048),
                 ("coalesced_kv", 3840), ("gqa_packing", 32768), ("fixed_block_attention", 32768),
                 ("fixed_block_attention", 65536), ("fixed_block_attention", 131072)]:
        assert (s, n) in lengths  # the write-up's lengths
    assert ablations.skip_reason("register_scan", "cuda") is None
    assert ablations.skip_reason("compiled_decode", "cuda") is None
    assert "Metal/CUDA" in ablations.skip_reason("compiled_decode", "sim")
    assert "no kernel" in ablations.skip_reason("chunked_prefill", "cuda")
    assert "no kernel on reference" in ablations.skip_reason("register_scan", "reference")
    # decode attention on CUDA: the fixed blocks from 32K; below, stock's SDPA with the switches on or off
    assert "has no kernel on cuda" in ablations.skip_reason("coalesced_kv", "cuda", length=3840)
    for switch in ("coalesced_kv", "gqa_packing", "fixed_block_attention"):
        assert ablations.skip_reason(switch, "cuda", length=32768) is None
    assert ablations.skip_reason("coalesced_kv", "sim", length=3840) is None  # the one-pass kernel
    assert ablations.skip_reason("fused_qk_prep", "cuda") is None
    assert ablations.skip_reason("dense_gemv", "cuda") == ablations.NO_KERNEL  # a trial kernel everywhere
    assert ablations.skip_reason("bounded_lookahead", "cuda") is None  # acts on every backend
    assert "ordinary decode path" in ablations.skip_reason("fixed_block_attention", "sim", length=3840)

    argv = ["--size", "tiny", "--num-layers", "4", "--lengths-scale", "0.01", "--rounds", "1",
            "--decode-rounds", "1", "--long-rounds", "1", "--profile-steps", "2", "--time-all",
            "--only", "register_scan,row_gemv,fused_expert_up,chunked_prefill", "--out", str(tmp_path)]
    assert ablations.main(argv + ["--stop-at", str(time.time() - 1)]) == 0  # nothing fits
    assert json.loads((tmp_path / "ablations.json").read_text())["complete"] is False
    assert ablations.main(argv) == 0
    data = json.loads((tmp_path / "ablations.json").read_text())
    got = {r["switch"]: r for r in data["rows"]}
    assert data["complete"] and got["chunked_prefill"]["skipped"] == ablations.GENERATION_LEVEL["chunked_prefill"]
    for s in ("row_gemv", "fused_expert_up"):  # one decode-profile run for both, shared prefill
        assert got[s]["phase"] == "decode" and got[s]["shared_prefill"]
        assert got[s]["on"] == got["row_gemv"]["on"] and got[s]["eval_ms_off"] > 0 and got[s]["build_ms_on"] > 0
    assert got["register_scan"]["metric"] == "prompt_tps" and got["register_scan"]["writeup_pct"] == 5.6
    table = (tmp_path / "ablations.md").read_text()
    assert "| `row_gemv` | decode |" in table and "eval ms/step on / off" in table
    assert ablations.main(argv) == 0  # all there: kept, nothing re-measured
    again = {r["switch"]: r for r in json.loads((tmp_path / "ablations.json").read_text())["rows"]}
    assert again["row_gemv"]["on"] == got["row_gemv"]["on"]
    with pytest.raises(SystemExit, match="profile_steps"):
        ablations.main(argv[:argv.index("--profile-steps") + 1] + ["3"] + argv[argv.index("--profile-steps") + 2:])


def test_plans_and_device_script(capsys):
    assert ablations.main(["--plan", "--plan-backend", "cuda", "--out", "/nonexistent/plan"]) == 0
    plan = capsys.readouterr().out
    assert "decode compiled_decode@4K" in plan and "not timed: chunked_prefill@16K" in plan and "call 1:" in plan
    calls = estimate.pack_calls([("a", 200), ("b", 200), ("c", 500)], 480, 100)
    assert [[n for n, _ in c] for c, _ in calls] == [["a"], ["b"], ["c"]]
    assert estimate.e2e_row_s(128 * 1024, ("stock", "lily"), 1, 64, True, True, True, {"stock": 16384}) < \
        estimate.e2e_row_s(128 * 1024, ("stock", "lily"), 1, 64, True, True)  # stock's 128K prefill left out
    subprocess.run(["bash", "-n", str(REPO / "bench" / "device_plan.sh")], check=True)


def test_device_pair_runs_one_job_per_gpu(tmp_path):
    """bench/device_pair.sh: each command sees its own GPU and PTX cache, its output lands in
    $OUT/gpu<N>.txt, and a failing job's status comes back."""
    import os

    script = str(REPO / "bench" / "device_pair.sh")
    env = {**os.environ, "OUT": str(tmp_path), "MLX_PTX_CACHE_DIR": str(tmp_path / "ptx")}
    show = 'echo "$CUDA_VISIBLE_DEVICES $MLX_PTX_CACHE_DIR"'
    done = subprocess.run(["bash", script, show, show + "; exit 3"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 3, done.stdout + done.stderr
    for gpu in (0, 1):
        assert (tmp_path / f"gpu{gpu}.txt").read_text().split() == [str(gpu), f"{tmp_path / 'ptx'}-gpu{gpu}"]
    assert subprocess.run(["bash", script, "only one"], env=env, capture_output=True).returncode == 2
