"""The benchmark harness (bench/) on the CPU: sweep bookkeeping, tables, op microbench timing, the
device script's syntax. The numbers here are CPU timings of a tiny model and mean nothing; the
structure and the stock-vs-lily comparison logic are what is tested."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from bench import e2e, kernels

REPO = Path(__file__).resolve().parents[2]


def test_lengths():
    assert e2e.parse_lengths("256, 1K,4k,128K") == [256, 1024, 4096, 131072]
    assert [e2e.length_label(n) for n in e2e.SWEEP_LENGTHS] == \
        ["256", "512", "1K", "2K", "4K", "8K", "16K", "32K", "64K", "128K"]


def test_uneven_rounds_are_flagged_in_the_log_the_row_and_the_notes(monkeypatch):
    """Rounds of one engine whose rates differ more than UNEVEN_ROUNDS (a compile inside a timed run, as a new KV
    capacity's merge once was): said in the log, kept in the row, and noted under the table; rounds within it,
    NaN and single rounds are not."""
    assert e2e.uneven_rounds([{"generation_tps": 26.8}, {"generation_tps": 178.5}], "generation_tps") == \
        pytest.approx(178.5 / 26.8)
    assert e2e.uneven_rounds([{"generation_tps": 150.0}, {"generation_tps": 178.5}], "generation_tps") is None
    assert e2e.uneven_rounds([{"generation_tps": float("nan")}, {"generation_tps": 9.0}], "generation_tps") is None
    assert e2e.uneven_rounds([{"generation_tps": 9.0}], "generation_tps") is None
    monkeypatch.setenv("LILY_BACKEND", "reference")
    from bench.model_setup import load_model

    model, _ = load_model(None, "tiny", log=None)
    real, calls = e2e.run_once, []

    def first_decode_slow(*args, **kwargs):  # the first run's decode as a compile would leave it: 10x slower
        res = real(*args, **kwargs)
        calls.append(1)
        return {**res, "generation_tps": res["generation_tps"] / (10.0 if len(calls) == 1 else 1.0)}

    monkeypatch.setattr(e2e, "run_once", first_decode_slow)
    lines = []
    rows = e2e.sweep(model, [24], [24], [24], rounds=2, gen_tokens=3, prefill_step_size=16, vocab_size=1024,
                     engines=("lily",), log=lines.append)
    assert rows[0]["lily"]["uneven"]["generation_tps"] > 2.0
    assert any("generation_tps differs" in line for line in lines)
    assert "decode rates differ" in e2e.notes_markdown(rows)


def test_sweep_compares_both_engines_on_one_model(monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", "reference")
    from bench.model_setup import load_model

    model, _ = load_model(None, "tiny", log=None)
    lines = []
    rows = e2e.sweep(model, [24, 40], [24, 40], [40], rounds=2, gen_tokens=3, prefill_step_size=16,
                     vocab_size=1024, log=lines.append)
    assert [r["length"] for r in rows] == [24, 40]
    # Alternating order: round 1 stock first, round 2 lily first.
    first = [l.split()[-4].rstrip(":") for l in lines if "round 1/2" in l]
    second = [l.split()[-4].rstrip(":") for l in lines if "round 2/2" in l]
    assert first[:2] == ["stock", "lily"] and second[:2] == ["lily", "stock"]
    r24, r40 = rows
    assert r24["decode_ratio"] is None and r24["stock"]["generation_tps"] is None  # prefill-only length
    assert r40["decode"] and r40["stock"]["generation_tps"] > 0 and r40["lily"]["generation_tps"] > 0
    assert r40["same_tokens"]  # reference backend: lily computes stock's function
    assert all(len(r[e]["trials"]) == 2 for r in rows for e in ("stock", "lily"))
    table = e2e.table_markdown(rows)
    assert sum(line.startswith("| ") for line in table.splitlines()) == 3 and "| 40 |" in table  # head + 2 rows
    import lily_mlx

    assert not lily_mlx.is_patched(model)  # the sweep leaves the model stock


def test_ablation_engines_run_lily_with_switches_off(monkeypatch):
    """``lily-off:a+b`` is lily with those switches off during its runs only; names are validated."""
    monkeypatch.setenv("LILY_BACKEND", "reference")
    from bench.model_setup import load_model
    from lily_mlx.core import switches

    assert e2e.switches_off("lily-off:gpu_routing+chunked_prefill") == ("gpu_routing", "chunked_prefill")
    assert e2e.switches_off("lily") == () and e2e.switches_off("stock") == ()
    # the @off- modifier: switches off for an engine whose name cannot say so (a trial kernel's switch), with others
    assert e2e.switches_off("lily-trial:linear_gemv@off-gemv_input_norm") == ("gemv_input_norm",)
    assert e2e.switches_off("lily-off:gpu_routing@off-fused_dequant+row_gemv@chunk-512") == (
        "gpu_routing", "fused_dequant", "row_gemv")
    assert e2e.trial_ops("lily-trial:linear_gemv@off-gemv_input_norm") == ("linear_gemv",)
    assert e2e.chunk_size("lily@off-gpu_routing@chunk-512", 2048) == 512
    e2e.validate_engine("lily-trial:linear_gemv@off-gemv_input_norm")
    # @again: the same engine under a second name (an A/A run), with or around the other modifiers
    assert e2e.base_engine("lily@again") == "lily" and e2e.is_lily("lily@again")
    assert e2e.switches_off("lily@again@off-gpu_routing") == e2e.switches_off("lily@off-gpu_routing@again") == (
        "gpu_routing",)
    assert e2e.base_engine("stock-kernels@again") == "stock-kernels" and not e2e.is_lily("stock@again")
    e2e.validate_engine("lily-trial:linear_gemv@again")
    with pytest.raises(ValueError, match="Valid switches"):
        e2e.switches_off("lily-off:no_such_switch")

    seen = []
    real_run_once = e2e.run_once

    def spy(model, prompt, gen, step):
        seen.append((switches.is_enabled("chunked_prefill"), step))
        return real_run_once(model, prompt, gen, step)

    monkeypatch.setattr(e2e, "run_once", spy)
    model, _ = load_model(None, "tiny", log=None)
    rows = e2e.sweep(model, [24], [24], [24], rounds=1, gen_tokens=2, prefill_step_size=8,
                     engines=("lily", "lily-off:chunked_prefill"), vocab_size=1024, log=lambda m: None)
    assert seen[0] == (True, 8)  # lily: MLX-LM's chunking
    assert seen[1][0] is False and seen[1][1] > 24  # ablation: the whole prompt in one chunk
    assert switches.is_enabled("chunked_prefill")  # restored after the run
    assert rows[0]["lily-off:chunked_prefill"]["prefill_vs_lily"] > 0
    assert "chunked_prefill" in e2e.ablation_markdown(rows)


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"length": n, "label": e2e.length_label(n), "prefill": True, "decode": True,
             "stock": {"prompt_tps": 100.0 + n, "generation_tps": 20.0},
             "lily": {"prompt_tps": 110.0 + n, "generation_tps": 25.0}} for n in (256, 1024)]
    assert e2e.plot(rows, str(tmp_path / "p.png"), "t") and (tmp_path / "p.png").stat().st_size > 1000


def test_op_cases_use_the_families_byte_and_flop_counts(monkeypatch):
    fake = types.ModuleType("lily_dev.fakefamily_bench")
    calls = []
    fake.microbench_cases = lambda: [("ok_case", lambda: calls.append(1), 10**9, 2 * 10**12),
                                     ("bad_case", lambda: 1 / 0, 1, 1)]
    monkeypatch.setitem(sys.modules, "lily_dev.fakefamily_bench", fake)
    rows = kernels.op_cases(families=("fakefamily",), min_seconds=0.0, max_iters=3,
                            ceil={"copy_GBps": 1000.0, "matmul_bf16_TFLOPs": 500.0}, log=lambda m: None)
    ok, bad = rows
    assert ok["case"] == "ok_case" and ok["GBps"] == pytest.approx(1e9 / (ok["us"] * 1e-6) / 1e9)
    assert ok["TFLOPs"] == pytest.approx(2e12 / (ok["us"] * 1e-6) / 1e12)
    assert len(calls) == 5  # two warm-ups, three timed
    assert "ZeroDivisionError" in bad["error"]
    assert "failed" in kernels.op_cases_markdown(rows)


def test_device_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(REPO / "bench" / "device_run.sh")], check=True)


def test_eval_per_layer_engines(monkeypatch):
    """``<engine>@eval-per-layer`` evaluates after each decoder layer of a prefill chunk, computes the
    same tokens, and leaves the layers' classes as they were; unknown engines are refused."""
    monkeypatch.setenv("LILY_BACKEND", "reference")
    import mlx.core as mx

    from bench.model_setup import load_model

    model, _ = load_model(None, "tiny", log=None)
    classes = [type(layer) for layer in model.layers]
    evals = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a, **k: (evals.append(1), real_eval(*a, **k))[1])

    def run(engines):
        evals.clear()
        rows = e2e.sweep(model, [24], [24], [24], rounds=1, gen_tokens=2, prefill_step_size=16,
                         vocab_size=1024, engines=engines, log=lambda m: None)
        return rows[0], len(evals)

    plain, n_plain = run(("stock",))
    per_layer, n_per_layer = run(("stock@eval-per-layer",))
    lily_per_layer, _ = run(("lily@eval-per-layer",))
    assert plain["stock"]["tokens"] == per_layer["stock@eval-per-layer"]["tokens"] \
        == lily_per_layer["lily@eval-per-layer"]["tokens"]
    # 24 tokens prefilled in chunks of 16: at least the first chunk evaluates once per layer.
    assert n_per_layer - n_plain >= len(classes)
    assert [type(layer) for layer in model.layers] == classes
    with pytest.raises(ValueError, match="unknown engine"):
        e2e.validate_engine("stock-fast")
    with pytest.raises(ValueError, match="Valid switches"):
        e2e.validate_engine("lily-off:nope@eval-per-layer")


def test_ablations_command_writes_the_table_and_resumes(monkeypatch, tmp_path):
    """`python -m bench.ablations` on the tiny model: one timed ablation (lily vs lily with the switch
    off; --time-all: the reference backend runs no kernel), one generation-level switch listed as such,
    the write-up's figure beside ours; a second run (--resume, the default) keeps what is in
    ablations.json."""
    import json

    from bench import ablations

    monkeypatch.setenv("LILY_BACKEND", "reference")
    argv = ["--size", "tiny", "--num-layers", "4", "--lengths-scale", "0.01", "--rounds", "1", "--gen-tokens", "2",
            "--only", "register_scan,chunked_prefill", "--time-all", "--out", str(tmp_path)]
    assert ablations.main(argv) == 0
    rows = {r["switch"]: r for r in json.loads((tmp_path / "ablations.json").read_text())["rows"]}
    assert rows["chunked_prefill"]["skipped"] == ablations.GENERATION_LEVEL["chunked_prefill"]
    scan = rows["register_scan"]
    assert scan["phase"] == "prefill" and scan["on"] > 0 and scan["off"] > 0 and scan["writeup_pct"] == 5.6
    table = (tmp_path / "ablations.md").read_text()
    assert "| `register_scan` | prefill |" in table and "+5.6 %" in table
    assert ablations.main(argv + ["--resume"]) == 0
    again = {r["switch"]: r for r in json.loads((tmp_path / "ablations.json").read_text())["rows"]}
    assert again["register_scan"]["on"] == scan["on"]  # kept, not re-measured


def test_decode_profile_engines_run_their_switch_states(monkeypatch):
    """decode-profile on the tiny model (simulated kernels): stock launches no lily kernel, lily its
    decode kernels, and a lily-off:<switch> engine really runs with that switch off (its kernels
    change: here the expert GEMMs instead of their GEMV forms)."""
    from lily_dev.moe_testing import simulator_problem

    if simulator_problem() is not None:
        pytest.skip(f"no C++ compiler for the simulator: {simulator_problem()}")
    monkeypatch.setenv("LILY_BACKEND", "sim")
    from bench import decode_profile
    from bench.model_setup import load_model

    model, _ = load_model(None, "tiny", log=None)
    profile = decode_profile.run(model, context=24, engines=["stock", "lily", "lily-off:row_gemv"], rounds=1,
                                 steps=2, vocab=1024, log=lambda m: None)
    rows = profile["engines"]
    assert rows["stock"]["kernel_launches_per_step"] == 0
    assert rows["lily"]["kernel_launches"].get("moe_gemv_gate_up_swiglu_routed", 0) > 0  # fused_topk_gemv
    off = rows["lily-off:row_gemv"]["kernel_launches"]
    assert off.get("moe_gemm_gate_up_swiglu_regtile", 0) > 0 and "moe_gemv_gate_up_swiglu" not in off
    table = decode_profile.table_markdown(profile)
    assert "lily kernel launches/step" in table
    # the breakdown by kind: one row per non-view primitive, a column per engine, counts that add up
    breakdown = table.split("by kind:\n\n")[1].split("\n\n")[0].splitlines()[2:]  # rows after the header
    kinds = {line.split(" | ")[0].strip("| ") for line in breakdown}
    stock = rows["stock"]["primitives"]
    assert kinds == {k for p in (r["primitives"] for r in rows.values()) for k in p
                     if k not in decode_profile.VIEW_PRIMITIVES}
    assert sum(n for k, n in stock.items() if k not in decode_profile.VIEW_PRIMITIVES) == rows["stock"]["primitives_per_step"]


def test_decode_profile_shared_prefill_decodes_every_engine_from_one_cache(monkeypatch):
    """--shared-prefill: the context is prefilled once per round and each engine decodes from its own
    copy (a copy's decode step leaves the original untouched, so the next engine starts from the same
    cache)."""
    monkeypatch.setenv("LILY_BACKEND", "reference")
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from bench import decode_profile
    from bench.model_setup import load_model

    model, _ = load_model(None, "tiny", log=None)
    cache = make_prompt_cache(model)
    def arrays(caches):
        out = []
        for c in caches:
            for v in c.__dict__.values():
                out += [a for a in (v if isinstance(v, list) else [v]) if isinstance(a, mx.array)]
        return out

    model(mx.arange(20)[None], cache=cache)
    mx.eval(arrays(cache))
    before = [mx.array(a) for a in arrays(cache)]
    offsets = [c.offset for c in cache if hasattr(c, "offset")]
    copy = decode_profile.clone_cache(cache)
    model(mx.array([[3]]), cache=copy)
    mx.eval(arrays(copy))
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, arrays(cache)))  # original untouched
    assert [c.offset for c in cache if hasattr(c, "offset")] == offsets
    assert [c.offset for c in copy if hasattr(c, "offset")] == [o + 1 for o in offsets]

    lines = []
    profile = decode_profile.run(model, context=24, engines=["stock", "lily"], rounds=1, steps=2, vocab=1024,
                                 log=lines.append, shared_prefill=True)
    assert profile["shared_prefill"] and profile["prefill_engine"] == "lily"
    assert sum("prefilled once" in line for line in lines) == 1
    assert set(profile["engines"]) == {"stock", "lily"}


@pytest.mark.parametrize("name, parts", [("device_decode_checks.sh", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47 or 48"),
                                         ("device_register_tiles.sh", "1, 2, 3, 4, 5, 6, 7 or 8")])
def test_device_scripts_are_valid_bash_and_refuse_an_unknown_part(tmp_path, name, parts):
    script = str(REPO / "bench" / name)
    subprocess.run(["bash", "-n", script], check=True)
    done = subprocess.run(["bash", script], env={"PATH": "/usr/bin:/bin", "PART": "99", "OUT": str(tmp_path)},
                          capture_output=True, text=True)
    assert done.returncode == 2 and f"PART must be {parts}" in done.stderr


def test_device_scripts_start_nothing_that_does_not_fit_their_budget(tmp_path):
    """With a 5-second budget the register-tile script's sweep (~400 s) is skipped, said in its log."""
    done = subprocess.run(["bash", str(REPO / "bench" / "device_register_tiles.sh")],
                          env={"PATH": "/usr/bin:/bin", "PART": "3", "BUDGET": "5", "OUT": str(tmp_path)},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "register_tiles" / "log.txt").read_text()
    assert "skipped sweep (needs ~400s" in log and "part 3 done" in log


def test_decode_profile_counts_a_step_that_does_not_grow_the_kv_cache():
    """MLX-LM's KVCache grows its buffers every 256 tokens (zeros + concatenation per cache): the decode
    profile counts the primitives of an ordinary step, one step later where the next one would grow them."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from bench import decode_profile

    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 2, 255, 8)), mx.zeros((1, 2, 255, 8)))
    assert not decode_profile._grows_kv_cache([cache])  # 255 of 256 rows used
    cache.update_and_fetch(mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 1, 8)))
    assert decode_profile._grows_kv_cache([cache, None])  # full: the next token allocates 256 more


def test_attention_bandwidth_line_from_a_kernel_table():
    """``step_gpu_time``'s attention line: the live partials and merge kernels' us a step against the K/V bytes the
    full-size model reads a step at that context (10 attention layers x K and V x 2 KV heads x 256 x bf16)."""
    import collections

    from bench.step_gpu_time import attention_bandwidth

    total = collections.Counter({"custom_kernel_attention_decode_block_partials_live_ab": 800.0,
                                 "custom_kernel_attention_decode_merge_live_blocks_cd": 200.0, "void qmv_kernel": 3e3})
    line = attention_bandwidth(total, 2, 32768)  # 400 + 100 us a step for 10 * 2 * 32768 * 2 * 256 * 2 bytes
    assert "partials 400.0 + merge 100.0 us" in line and "0.671 GB" in line and ": 1342 GB/s" in line
    assert attention_bandwidth(collections.Counter({"void qmv_kernel": 1.0}), 1, 4096) == ""
    with_copy = attention_bandwidth(total, 2, 32768, copy_gbs=2684.0)
    assert with_copy.startswith(line) and "; 50 % (63 %) of the copy ceiling, 2684 GB/s" in with_copy


def test_kernel_caches_survive_a_save_and_restore_in_parts(tmp_path):
    """``bench/device_kernel_cache.sh``: the compile caches saved as xz parts under 15 MiB (what a device call brings
    back) and restored elsewhere give the same files, byte for byte; ``env`` points both compilers at them."""
    import os
    import shutil
    import subprocess

    if shutil.which("xz") is None:
        pytest.skip("xz not installed")
    script = str(REPO / "bench" / "device_kernel_cache.sh")
    kc, out, again = tmp_path / "kc", tmp_path / "out", tmp_path / "again"
    (kc / "ptx" / "sub").mkdir(parents=True)
    (kc / "nv").mkdir()
    files = {"ptx/a.ptx": b"// ptx\n" * 1000, "ptx/sub/b.ptx": b"x", "nv/index": os.urandom(16 * 2**20)}  # 2 parts
    for name, data in files.items():
        (kc / name).write_bytes(data)
    subprocess.run(["bash", script, "save", str(out)], env={**os.environ, "KC": str(kc), "KC_XZ_LEVEL": "-0"},
                   check=True, capture_output=True)
    parts = sorted(p.name for p in out.iterdir())
    assert parts == ["kcache.tar.xz.part-aa", "kcache.tar.xz.part-ab"], parts
    assert all((out / p).stat().st_size <= 15 * 2**20 for p in parts)
    subprocess.run(["bash", script, "restore", str(out)], env={**os.environ, "KC": str(again)}, check=True,
                   capture_output=True)
    for name, data in files.items():
        assert (again / name).read_bytes() == data, name
    env = subprocess.run(["bash", script, "env"], env={**os.environ, "KC": "/k"}, check=True, capture_output=True,
                         text=True).stdout
    assert "MLX_PTX_CACHE_DIR=/k/ptx" in env and "CUDA_CACHE_PATH=/k/nv" in env
    assert subprocess.run(["bash", script, "restore", str(tmp_path / "none")], capture_output=True).returncode != 0


def test_chunk_modifier_engines(monkeypatch):
    """``<engine>@chunk-N`` prefills in chunks of N tokens (the others keep the run's step) in the same
    alternating sweep, computes the same tokens, is compared with lily in its own table, and asks the
    warm-up for its chunk sizes; bad sizes are refused."""
    monkeypatch.setenv("LILY_BACKEND", "reference")
    from bench.model_setup import load_model

    steps = []
    real_run_once = e2e.run_once

    def spy(model, prompt, gen, step):
        steps.append(step)
        return real_run_once(model, prompt, gen, step)

    monkeypatch.setattr(e2e, "run_once", spy)
    model, _ = load_model(None, "tiny", log=None)
    engines = ("lily", "lily@chunk-8", "stock@chunk-8@eval-per-layer")
    rows = e2e.sweep(model, [24], [24], [24], rounds=2, gen_tokens=2, prefill_step_size=16,
                     engines=engines, vocab_size=1024, log=lambda m: None)
    assert steps == [16, 8, 8, 8, 8, 16]  # round 1 in order, round 2 reversed
    row = rows[0]
    assert row["lily"]["tokens"] == row["lily@chunk-8"]["tokens"] == row["stock@chunk-8@eval-per-layer"]["tokens"]
    table = e2e.variant_markdown(rows)
    assert "| 24 | lily@chunk-8 |" in table and "| 24 | stock@chunk-8@eval-per-layer |" in table
    assert e2e.variant_markdown([{k: v for k, v in row.items() if "@" not in k}]) == ""
    assert e2e.chunk_sizes(engines, 16) == [8, 16]
    assert e2e.base_engine("lily-off:gqa_packing@chunk-4096") == "lily-off:gqa_packing"
    for bad in ("lily@chunk-0", "lily@chunk-x", "lily@chunk-"):
        with pytest.raises(ValueError, match="positive whole number"):
            e2e.validate_engine(bad)
