"""``python -m lily_mlx tune`` and the tune profile ``patch()`` applies (docs/usage.md, "Tuning for your
machine").

The CLI runs for real on the simulator with the embedded model. What it chooses depends on timings,
so no test asserts a choice it made; the tests assert that it checked every kernel, wrote a profile
and a report, and that ``patch()`` applies exactly what the profile says. Hand-written profiles pin
the behaviour of ``patch()`` deterministically.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import lily_mlx
from lily_mlx.consistency import teacher_forced_logits
from lily_mlx.core import environment, switches, tune_profile
from lily_mlx.core.kernel_registry import record_launches
from lily_mlx.core.log import reset_log_once
from lily_mlx.ops import load_all

from .conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
SIM_KERNEL_OPS = sorted(name for name, op in load_all().items() if "sim" in op.kernel_backends)
SIM_TRIAL_OPS = sorted(name for name, op in load_all().items() if "sim" in op.trial_backends)


@pytest.fixture
def tune_dir(tmp_path, monkeypatch):
    """Profiles in a fresh folder, the simulator as backend; switch states restored afterwards."""
    monkeypatch.setenv("LILY_TUNE_DIR", str(tmp_path))
    monkeypatch.setenv("LILY_BACKEND", "sim")
    monkeypatch.delenv("LILY_TUNE", raising=False)
    reset_log_once()
    yield tmp_path
    switches.reset()
    reset_log_once()


@pytest.fixture
def sim_model(loaded_model):
    model, tokenizer = loaded_model
    yield model, tokenizer
    lily_mlx.unpatch(model)


def write_profile(folder: Path, ops=(), switches_off=(), trials_on=(), **key_changes) -> Path:
    """A profile as tune writes it, by hand: ``ops`` run their reference, ``switches_off`` are off,
    ``trials_on`` are trial kernels it turned on."""
    key = {**tune_profile.device_key("sim"), **key_changes}
    profile = {
        "format": tune_profile.FORMAT, "key": key, "model": "hand-written",
        "ops": {**{name: {"choice": "reference", "reason": "hand-written"} for name in ops},
                **{name: {"choice": "kernel", "trial": True, "reason": "hand-written"} for name in trials_on}},
        "switches": {name: {"choice": "off", "reason": "hand-written"} for name in switches_off},
    }
    path = folder / tune_profile.profile_filename(key)
    path.write_text(json.dumps(profile))
    return path


def _logits(model, tokenizer):
    """Prefill of a prompt, then 3 teacher-forced decode steps: [4, vocab] fp32."""
    tokens = mx.array(tokenizer.encode("Return a new dictionary with the keys of the mapping"))
    return teacher_forced_logits(model, tokens[:-3], tokens[-4:])


def test_tune_quick_checks_every_kernel_and_writes_a_profile_patch_applies(tune_dir, sim_model):
    env = subprocess_env()
    env.update(LILY_BACKEND="sim", LILY_TUNE_DIR=str(tune_dir))
    proc = subprocess.run([sys.executable, "-m", "lily_mlx", "tune", "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = tune_dir / tune_profile.profile_filename(tune_profile.device_key("sim"))
    assert sorted(p.name for p in tune_dir.iterdir()) == sorted([path.name, path.with_suffix(".md").name])
    profile = json.loads(path.read_text())
    assert sorted(profile["ops"]) == sorted(SIM_KERNEL_OPS + SIM_TRIAL_OPS)
    assert all(profile["ops"][name]["trial"] for name in SIM_TRIAL_OPS)
    # Step 1: every kernel op checked at each shape class; on the simulator none differs.
    assert {c["what"] for c in profile["checks"]} >= set(SIM_KERNEL_OPS)
    assert all(c["ok"] for c in profile["checks"]), [c for c in profile["checks"] if not c["ok"]]
    # The quantized-cache decode kernel runs at the class with a 4-bit KV cache (and only the attention layer's
    # checks take that class).
    assert {c["class"] for c in profile["checks"] if c["what"] == "attention_decode_quantized" and c["ran"]} == {
        "decode@32/kv4"}
    attention_checks = {
        "attention kernels together", *[op for op in SIM_KERNEL_OPS if op.startswith("attention_")],
        *[f"{op} ({s} off)" for op in SIM_KERNEL_OPS if op.startswith("attention_")
          for s in ("gqa_packing", "coalesced_kv", "fixed_block_attention", "fused_output_gate", "fused_qk_prep",
                    "fused_qkv_proj")]}
    assert {c["what"] for c in profile["checks"] if c["class"] == "decode@32/kv4"} <= attention_checks
    # A server's batch (a BatchKVCache of 4 rows): the batch op's kernel runs there and only there, and only the
    # attention layer's checks take that class.
    assert {c["class"] for c in profile["checks"] if c["what"] == "attention_decode_batch" and c["ran"]} == {
        "decode@32/b4"}
    assert {c["what"] for c in profile["checks"] if c["class"] == "decode@32/b4"} <= attention_checks
    # Step 2 ran and said so, one line per measurement.
    assert "[tune] check 1/" in proc.stdout and "[tune] time 1/" in proc.stdout
    assert profile["op_timings"] and "## Choices" in path.with_suffix(".md").read_text()
    # Step 3 ran with the choices made (whatever they were, the simulator keeps a token's bits).
    assert [r["equal"] for r in profile["invariance"]] == [True], profile["invariance"]
    assert "## Batch invariance" in path.with_suffix(".md").read_text() and "[tune] invariance:" in proc.stdout

    # Whatever the timings chose, patch() applies exactly that.
    model, _ = sim_model
    report = lily_mlx.patch(model)._lily_report
    for name, entry in profile["ops"].items():
        assert report.op_backends[name] == ("reference" if entry["choice"] == "reference" else "sim"), name
    for name, entry in profile["switches"].items():
        assert switches.is_enabled(name) == (entry["choice"] == "on"), name
    assert f"tune profile: {path}" in report.summary()


def test_a_wrong_kernel_is_pinned_with_its_reason(tune_dir, sim_model, monkeypatch):
    """Step 1 of tune with a planted bug: the scan kernel's final state is halved. Its output is right,
    so only the decode step that follows each checked call shows it. The scan is pinned (not its
    family), and the DeltaNet decode op follows it to the reference."""
    from lily_mlx.ops.deltanet import kernels as dk
    from lily_mlx.tuning import tune

    real_scan = dk.scan

    def scan_with_wrong_state(*args, **kwargs):
        out, state = real_scan(*args, **kwargs)
        return out, state * 0.5

    monkeypatch.setattr(dk, "scan", scan_with_wrong_state)
    monkeypatch.setenv("LILY_TUNE", "off")
    model, _ = sim_model
    lily_mlx.patch(model)
    bench = tune.Bench(model, tune.QUICK_CLASSES)
    _, pinned, bad_off = tune.check_kernels(bench, tune.kernel_ops(bench, "sim"))
    assert list(pinned) == ["deltanet_scan"]
    assert pinned["deltanet_scan"].startswith("kernel differs from its reference at decode@32")
    # Off variants that run the scan kernel: the blockwise scan, the unstaged register scan, and the
    # unfused decode step.
    assert sorted(bad_off) == ["fused_recurrent_norm", "register_scan", "staged_scan"]
    assert tune.follow(pinned) == {"deltanet_decode": "follows deltanet_scan to its reference (batch invariance)"}


def test_tune_checks_the_moe_batch_invariance_across_its_decode_and_chunk_forms(tune_dir, sim_model, monkeypatch):
    """Step 3 compares a token's MoE output alone, in a decode batch and in a prompt chunk: the decode forms (row
    GEMVs) against the GEMM tiles, two different kernels, bitwise equal on the simulator."""
    from lily_mlx.tuning import tune

    monkeypatch.setenv("LILY_TUNE", "off")
    model, _ = sim_model
    lily_mlx.patch(model)
    bench = tune.Bench(model, tune.QUICK_CLASSES)
    with record_launches() as launches:
        rows, off = tune.check_invariance(bench, {}, {})
    assert [r["equal"] for r in rows] == [True] and off == {}
    names = set(launches.names())
    assert "moe_gemv_gate_up_swiglu_routed" in names and any(n.startswith("moe_gemm_gate_up") for n in names), names


def test_a_device_where_the_moe_forms_differ_turns_row_gemv_off(tune_dir, sim_model, monkeypatch, capsys):
    """Step 3 with a planted difference (the decode forms' down GEMV + combine a little off, as a device whose
    matrix multiply-accumulate adds in another order would make it): with row_gemv on a token's bits differ between
    a decode call and a prompt chunk, with it off they agree, so row_gemv goes off with that reason; the report
    shows both checks."""
    from lily_mlx.ops.moe import kernels as mk
    from lily_mlx.tuning import report, tune

    real = mk.gemv_down_combine
    monkeypatch.setattr(mk, "gemv_down_combine", lambda *args, **kwargs: real(*args, **kwargs) * 1.0625)
    monkeypatch.setenv("LILY_TUNE", "off")
    model, _ = sim_model
    lily_mlx.patch(model)
    bench = tune.Bench(model, tune.QUICK_CLASSES)
    rows, off = tune.check_invariance(bench, {}, {})
    assert [r["equal"] for r in rows] == [False, True]
    assert list(off) == ["row_gemv"] and off["row_gemv"].startswith("batch invariance")
    text = report.markdown({"key": {"device": "d", "backend": "sim", "mlx": "m", "lily": "l"}, "model": "embedded",
                            "command": "c", "created": "now", "classes": [], "rounds": 1, "tolerance": 0.1,
                            "slower_ratio": 1.03, "ops": {}, "switches": {}, "checks": [], "op_timings": [],
                            "switch_timings": [], "invariance": rows})
    assert "**differ**" in text and "(row_gemv off)" in text

    # Where step 1 found row_gemv's off state wrong, it is not chosen; the run warns instead.
    rows, off = tune.check_invariance(bench, {}, {}, {"row_gemv": "off variant of moe_grouped_gemm: wrong"})
    assert [r["equal"] for r in rows] == [False] and off == {}
    assert "warning: the MoE block is not batch invariant on this device (a token" in capsys.readouterr().out


def test_the_invariance_check_of_a_chunk_reaches_the_large_tiles(tune_dir, sim_model, monkeypatch):
    """The prompt chunk of step 3 gives the experts, on average, the rows of the large (32-row) tiles, as a real
    prompt chunk does: both tile sizes run."""
    from lily_mlx.tuning import tune

    monkeypatch.setenv("LILY_TUNE", "off")
    model, _ = sim_model
    lily_mlx.patch(model)
    with record_launches() as launches:
        tune._moe_invariance_once(tune.Bench(model, tune.QUICK_CLASSES), "chunk")
    tiles = set()
    for launch in launches:
        if launch.name.startswith("moe_gemm_gate_up"):
            blocks = launch.kwargs["inputs"][2]
            tiles |= {int(t) for t, n in zip(blocks[:, 3].tolist(), blocks[:, 2].tolist()) if n > 0}
    assert tiles == {16, 32}, tiles


def test_a_profile_pinning_every_kernel_gives_stock_logits(tune_dir, sim_model):
    """Every op with a simulator kernel pinned to its reference: no kernel launches, and the logits
    are stock's bit for bit (the references are stock's primitives in stock's order)."""
    model, tokenizer = sim_model
    stock = _logits(model, tokenizer)
    path = write_profile(tune_dir, ops=SIM_KERNEL_OPS)
    report = lily_mlx.patch(model)._lily_report
    assert set(report.op_backends.values()) == {"reference"}
    assert report.reference_reasons["moe_grouped_gemm"] == "tune profile: hand-written"
    with record_launches() as launches:
        tuned = _logits(model, tokenizer)
    assert not launches.names()
    assert mx.array_equal(tuned, stock).item()
    assert report.tune_profile.startswith(f"tune profile: {path}")


def test_a_profile_pins_one_op_and_turns_a_switch_off_until_tune_is_off(tune_dir, sim_model, monkeypatch):
    model, tokenizer = sim_model
    write_profile(tune_dir, ops=["moe_grouped_gemm"], switches_off=["register_scan"])
    report = lily_mlx.patch(model)._lily_report
    assert report.op_backends["moe_grouped_gemm"] == "reference"
    assert report.op_backends["deltanet_scan"] == "sim"
    assert not switches.is_enabled("register_scan") and "register_scan" in report.switches_off
    with record_launches() as launches:
        _logits(model, tokenizer)
    assert not [n for n in launches.names() if n.startswith("moe_") and n != "moe_residual_rms_norm"]  # (its own op)
    assert "deltanet_scan_blockwise" in launches.names()  # register_scan off: the blockwise scan

    monkeypatch.setenv("LILY_TUNE", "off")
    report = lily_mlx.patch(model)._lily_report
    assert report.op_backends["moe_grouped_gemm"] == "sim"
    assert switches.is_enabled("register_scan")
    assert report.tune_profile == "tune profile: off (LILY_TUNE=off)"


def test_the_user_enabling_a_switch_wins_over_the_profile(tune_dir, sim_model, monkeypatch):
    model, _ = sim_model
    write_profile(tune_dir, switches_off=["register_scan", "gpu_routing"])
    monkeypatch.setenv("LILY_ENABLE", "register_scan")
    switches.reset()
    lily_mlx.patch(model)
    assert switches.is_enabled("register_scan") and not switches.is_enabled("gpu_routing")


def test_switches_set_at_run_time_win_over_the_profile(tune_dir, sim_model):
    """``--lily-enable`` / ``--lily-disable`` (``switches.enable`` / ``disable``) before ``patch()``: the profile it
    resolves does not undo them, neither a switch it measured slower nor a default-off switch it records as off;
    and a switch the user turned off stays off when a profile that had turned it off is gone."""
    model, _ = sim_model
    write_profile(tune_dir, switches_off=["register_scan", "split_k_gate_up", "gpu_routing"])
    try:
        switches.enable("register_scan", "split_k_gate_up")
        switches.disable("gpu_routing")
        lily_mlx.patch(model)
        assert switches.is_enabled("register_scan") and switches.is_enabled("split_k_gate_up")
        write_profile(tune_dir, switches_off=[])
        lily_mlx.patch(model)
        assert not switches.is_enabled("gpu_routing")
    finally:
        switches.reset()


def test_profiles_of_other_devices_or_versions_are_ignored_with_one_log_line(tune_dir, sim_model, caplog):
    model, _ = sim_model
    write_profile(tune_dir, ops=SIM_KERNEL_OPS, lily="0.0.1")  # another lily-mlx version
    with caplog.at_level(logging.INFO, logger="lily_mlx"):
        for _ in range(2):
            report = lily_mlx.patch(model)._lily_report
    assert report.tune_profile == "tune profile: none"
    assert report.op_backends["moe_grouped_gemm"] == "sim"
    lines = [r.getMessage() for r in caplog.records if "tune profile" in r.getMessage()]
    assert len(lines) == 1 and "lily0.0.1" in lines[0], lines


def test_a_copied_profile_whose_key_does_not_match_is_ignored(tune_dir, sim_model, caplog):
    """A file with this machine's name but another machine's key inside (copied by hand)."""
    model, _ = sim_model
    other = write_profile(tune_dir, ops=SIM_KERNEL_OPS, device="Apple M5 Max")
    other.rename(tune_dir / tune_profile.profile_filename(tune_profile.device_key("sim")))
    with caplog.at_level(logging.INFO, logger="lily_mlx"):
        report = lily_mlx.patch(model)._lily_report
    assert report.op_backends["moe_grouped_gemm"] == "sim"
    assert any("Apple M5 Max" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("value,ok", [("", True), ("on", True), ("off", True), ("OFF", True),
                                      ("0", False), ("maybe", False)])
def test_lily_tune_values(monkeypatch, value, ok):
    monkeypatch.setenv("LILY_TUNE", value)
    problems = [p for p in environment.problems() if "LILY_TUNE" in p]
    assert (problems == []) == ok, problems
    if not ok:
        assert problems == [f"LILY_TUNE={value!r} is not one of on, off (off: ignore tune profiles)"]


# --------------------------------------------------------------------------------------------------
# Trial kernels (Op.trial_backends): on only where a tune profile measured them faster


@pytest.fixture
def qk_prep_as_trial(monkeypatch):
    """The q/k preparation kernel as a trial kernel of the simulator (the tests' example of a trial kernel)."""
    import dataclasses

    from lily_mlx.core import dispatch

    op = dispatch.OPS["attention_qk_prep"]
    monkeypatch.setitem(dispatch.OPS, "attention_qk_prep",
                        dataclasses.replace(op, kernel_backends=frozenset(), trial_backends=frozenset({"sim"})))
    dispatch.invalidate()
    yield "attention_qk_prep"
    dispatch.invalidate()


def test_a_trial_kernel_runs_only_where_the_profile_turned_it_on(tune_dir, sim_model, qk_prep_as_trial, monkeypatch):
    model, tokenizer = sim_model
    report = lily_mlx.patch(model)._lily_report  # no profile: the trial kernel stays off
    assert report.op_backends["attention_qk_prep"] == "reference"
    assert "trial kernel" in report.reference_reasons["attention_qk_prep"]
    with record_launches() as launches:
        _logits(model, tokenizer)
    assert "attention_qk_prep" not in launches.names()

    path = write_profile(tune_dir, trials_on=["attention_qk_prep"])
    report = lily_mlx.patch(model)._lily_report
    assert report.op_backends["attention_qk_prep"] == "sim"
    assert "trial kernel(s) on: attention_qk_prep" in report.tune_profile and str(path) in report.tune_profile
    with record_launches() as launches:
        _logits(model, tokenizer)
    assert "attention_qk_prep" in launches.names()

    monkeypatch.setenv("LILY_REFERENCE_OPS", "attention_qk_prep")  # the user's word still wins
    assert lily_mlx.patch(model)._lily_report.op_backends["attention_qk_prep"] == "reference"
    monkeypatch.delenv("LILY_REFERENCE_OPS")
    monkeypatch.setenv("LILY_TUNE", "off")
    assert lily_mlx.patch(model)._lily_report.op_backends["attention_qk_prep"] == "reference"


def test_lily_trial_ops_turns_a_trial_kernel_on_without_a_profile(tune_dir, sim_model, qk_prep_as_trial, monkeypatch):
    """LILY_TRIAL_OPS names trial kernels to run (no tune run needed); LILY_REFERENCE_OPS still wins; a
    name that is not a trial kernel is a one-line error before patching."""
    from lily_mlx.core import environment

    model, tokenizer = sim_model
    monkeypatch.setenv("LILY_TRIAL_OPS", "attention_qk_prep")
    assert lily_mlx.patch(model)._lily_report.op_backends["attention_qk_prep"] == "sim"
    with record_launches() as launches:
        _logits(model, tokenizer)
    assert "attention_qk_prep" in launches.names()
    monkeypatch.setenv("LILY_REFERENCE_OPS", "attention_qk_prep")
    assert lily_mlx.patch(model)._lily_report.op_backends["attention_qk_prep"] == "reference"
    monkeypatch.delenv("LILY_REFERENCE_OPS")
    monkeypatch.setenv("LILY_TRIAL_OPS", "moe_router")
    problems = environment.problems()
    assert any("LILY_TRIAL_OPS='moe_router': not a trial kernel 'moe_router'" in p for p in problems), problems
    with pytest.raises(environment.LilyConfigError, match="LILY_TRIAL_OPS"):
        lily_mlx.patch(model)


def test_tune_checks_and_times_a_trial_kernel_and_records_its_choice(tune_dir, sim_model, qk_prep_as_trial):
    """tune() with the q/k preparation kernel as a trial kernel: it is checked and timed like the others
    and the profile says trial, with a choice and its reason; patch() then applies that choice. The dense
    projections' row GEMV (a trial kernel on every backend) is checked and timed on its own case, the first decoder
    layer's in-projection, alike."""
    from lily_mlx.tuning import layers, tune

    model, _ = sim_model
    with record_launches() as launches:
        profile = tune.tune(model, "embedded", (layers.decode(32),), rounds=1, reps=1)
    assert "attention_qk_prep" in launches.names() and "linear_gemv_q4" in launches.names()
    for name in ("attention_qk_prep", "linear_gemv"):
        entry = profile["ops"][name]
        assert entry["trial"] is True and entry["choice"] in ("kernel", "reference"), entry
        assert entry["reason"].startswith("trial kernel") or entry["choice"] == "reference", entry
        assert any(c["what"] == name and c["ran"] and c["ok"] for c in profile["checks"])
        assert any(r["op"] == name for r in profile["op_timings"])
    assert all("trial" not in e for name, e in profile["ops"].items() if name not in ("attention_qk_prep",
                                                                                      "linear_gemv"))
    tune.write(profile, tune_dir)
    lily_mlx.unpatch(model)
    report = lily_mlx.patch(model)._lily_report
    for name in ("attention_qk_prep", "linear_gemv"):
        want = "sim" if profile["ops"][name]["choice"] == "kernel" else "reference"
        assert report.op_backends[name] == want, (name, report.op_backends[name])


def test_tune_has_a_case_for_every_op_family(sim_model):
    """Every op family has a layer tune checks and times its kernels on (a family without one would leave its trial
    kernels off on every device): the linear family's is the first decoder layer's largest projection of its
    normed input, called alone (no cache), which the row GEMV computes in a decode step."""
    from lily_mlx.core.dispatch import OPS
    from lily_mlx.tuning import layers

    model, _ = sim_model
    lily_mlx.patch(model)
    cases = layers.layer_cases(model)
    assert {op.family for op in OPS.values()} <= set(cases), sorted(cases)
    case = cases["linear"]
    first = model.layers[case.index]
    assert case.index == 0 and case.norm is first.input_layernorm
    mixer = first.linear_attn if hasattr(first, "linear_attn") else first.self_attn
    widths = {name: m["weight"].shape[0] for name, m in mixer.children().items()
              if hasattr(m, "bits") and m["weight"].shape[-1] * 32 // m.bits == case.norm.weight.shape[-1]}
    assert case.module is getattr(mixer, max(widths, key=widths.get)), widths
    x = case.inputs(1, 0)  # [1, 1, hidden]: a decode call's row
    with record_launches() as launches:
        y = case(x)
        mx.eval(y)
    assert launches.names() == [] and y.shape == (1, 1, max(widths.values()))  # the trial GEMV is off as it ships


def test_a_kernel_that_fails_to_run_is_pinned_not_fatal(tune_dir, sim_model, monkeypatch):
    """A kernel that raises in tune's check (e.g. it does not compile on this GPU) is pinned to its
    reference with the error as the reason, and the check goes on."""
    from lily_mlx.ops.deltanet import kernels as dk
    from lily_mlx.tuning import tune

    def broken_scan(*args, **kwargs):
        raise RuntimeError("unable to build the kernel\nsecond line")

    monkeypatch.setattr(dk, "scan", broken_scan)
    monkeypatch.setenv("LILY_TUNE", "off")
    model, _ = sim_model
    lily_mlx.patch(model)
    bench = tune.Bench(model, tune.QUICK_CLASSES)
    rows, pinned, _ = tune.check_kernels(bench, tune.kernel_ops(bench, "sim"))
    assert pinned["deltanet_scan"] == "kernel failed at decode@32 (RuntimeError: unable to build the kernel)"
    assert any(r.get("failure") for r in rows) and any(r["ok"] and r["ran"] for r in rows)


def test_every_trial_kernel_has_a_launcher_on_its_trial_backends():
    """A profile that turns a trial kernel on for Metal or CUDA must reach a kernel there: each op's
    launcher table holds every backend the op can run a kernel on, trial backends included."""
    from lily_mlx.core import dispatch
    from lily_mlx.ops import load_all
    from lily_mlx.ops.attention import layer as attention_layer

    ops = [op for op in load_all().values() if op.trial_backends]
    assert {op.name for op in ops} >= {"attention_prefill", "attention_decode", "linear_gemv"}
    for op in ops:
        assert op.family in ("attention", "linear"), op.name  # the families with trial kernels so far
        if op.family == "linear":  # no launcher table: get_kernel(spec, backend) builds it for any backend
            continue  # (no tune case either: LILY_TRIAL_OPS turns it on)
        for backend in op.trial_backends | op.kernel_backends:
            assert (op.name, backend) in attention_layer.KERNELS, (op.name, backend)
    assert dispatch.OPS["attention_prefill"].trial_backends == {"metal", "cuda"}


@pytest.mark.parametrize("where", ["--out", "LILY_TUNE_DIR"])
def test_a_profile_folder_that_cannot_be_written_is_an_error_before_measuring(tmp_path, monkeypatch, capsys, where):
    """Said at the start, not after minutes of measuring: a file where the folder should be."""
    from lily_mlx.tuning import tune

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(tune, "tune", lambda *a, **k: pytest.fail("measured before checking the folder"))
    argv = ["--quick"] + (["--out", str(blocker / "sub")] if where == "--out" else [])
    if where == "LILY_TUNE_DIR":
        monkeypatch.setenv("LILY_TUNE_DIR", str(blocker))
    with pytest.raises(SystemExit) as exit_info:
        tune.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{blocker} is not a folder" in err and (("LILY_TUNE_DIR" in err) == (where == "LILY_TUNE_DIR"))
