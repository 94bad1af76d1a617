"""lily_mlx.switches: defaults, environment, API, overrides, validation."""

import os
import subprocess
import sys

import pytest

from lily_mlx.core import switches

ENV = ("LILY_DISABLE", "LILY_ENABLE")
REQUIRED = (  # the names the write-up's optimisations go by; they must stay stable
    "fused_dequant", "gpu_routing", "adaptive_tile", "register_scan", "chunked_prefill",
    "row_gemv", "fused_expert_up", "fused_expert_down", "fused_qk_prep", "fused_recurrent_norm",
    "coalesced_kv", "gqa_packing", "fixed_block_attention",
)


@pytest.fixture(autouse=True)
def clean_switches():
    """Each test starts from defaults with no switch environment, and leaves it that way."""
    saved = {k: os.environ.pop(k, None) for k in ENV}
    switches.reset()
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    switches.reset()


def run_python(code, **env):
    full = {k: v for k, v in os.environ.items() if k not in ENV}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_registry_complete_and_well_formed():
    assert set(REQUIRED) <= set(switches.SWITCHES)
    for name, s in switches.SWITCHES.items():
        assert s.name == name
        assert s.family in ("moe", "deltanet", "attention", "linear", "generation")
        assert s.phase in ("prefill", "decode", "both")
        assert isinstance(s.default, bool)
        assert s.description.strip() and s.off_meaning.strip()
        assert "stock" not in s.off_meaning.lower(), "off is the ablation variant, never stock"


def test_defaults():
    assert switches.state() == {n: s.default for n, s in switches.SWITCHES.items()}
    for n, s in switches.SWITCHES.items():
        assert switches.is_enabled(n) is s.default


def test_disable_enable_set_enabled():
    switches.disable("gpu_routing", "row_gemv")
    assert not switches.is_enabled("gpu_routing") and not switches.is_enabled("row_gemv")
    switches.enable("gpu_routing")
    assert switches.is_enabled("gpu_routing") and not switches.is_enabled("row_gemv")
    switches.set_enabled("row_gemv", 1)
    assert switches.is_enabled("row_gemv") is True


def test_state_is_a_copy():
    s = switches.state()
    s["gpu_routing"] = not s["gpu_routing"]
    assert switches.is_enabled("gpu_routing") is switches.SWITCHES["gpu_routing"].default


def test_env_read_by_reset(monkeypatch):
    monkeypatch.setenv("LILY_DISABLE", "gpu_routing, row_gemv,")
    monkeypatch.setenv("LILY_ENABLE", "row_gemv")  # ENABLE applies after DISABLE
    switches.reset()
    assert not switches.is_enabled("gpu_routing")
    assert switches.is_enabled("row_gemv")
    assert switches.is_enabled("fused_dequant")


def test_env_read_at_import():
    code = ("from lily_mlx.core import switches as s; "
            "print(s.is_enabled('gqa_packing'), s.is_enabled('coalesced_kv'), s.is_enabled('row_gemv'))")
    out = run_python(code, LILY_DISABLE="gqa_packing,coalesced_kv", LILY_ENABLE="coalesced_kv")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "True"]


def test_unknown_env_name_never_breaks_import_and_is_reported():
    """A typo in a shell profile must not break ``import lily_mlx`` (MLX-LM's CLIs import it through
    the hook even without --lily): the valid names apply, the bad one is reported with the valid list."""
    code = ("from lily_mlx.core import switches as s; print(s.is_enabled('gpu_routing')); "
            "print(s.environment_problems()[0])")
    out = run_python(code, LILY_DISABLE="gpu_routing,no_such_switch")
    assert out.returncode == 0, out.stderr
    applied, problem = out.stdout.splitlines()
    assert applied == "False"
    assert "no_such_switch" in problem and "fixed_block_attention" in problem


def test_wrong_case_name_suggests_the_right_one(monkeypatch):
    monkeypatch.setenv("LILY_ENABLE", "GPU_Routing")
    assert "did you mean 'gpu_routing'" in switches.environment_problems()[0]
    with pytest.raises(ValueError, match="did you mean 'gpu_routing'"):
        switches.disable("GPU_Routing")


def test_a_removed_switch_is_named_with_why(monkeypatch):
    """A switch that was removed (switches.REMOVED) is still refused, with the reason it went rather than a guess."""
    assert "long_live_blocks" not in switches.SWITCHES
    monkeypatch.setenv("LILY_ENABLE", "long_live_blocks")
    problem = switches.environment_problems()[0]
    assert "'long_live_blocks' (removed on 2026-12-05" in problem and "did you mean" not in problem
    with pytest.raises(ValueError, match="removed on 2026-12-05"):
        switches.enable("long_live_blocks")


@pytest.mark.parametrize("call", [
    lambda: switches.disable("gpu_routing", "bogus"),
    lambda: switches.enable("bogus"),
    lambda: switches.is_enabled("bogus"),
    lambda: switches.set_enabled("bogus", True),
    lambda: switches.parse_list("row_gemv,bogus"),
    lambda: switches.overrides(disable=["bogus"]).__enter__(),
])
def test_unknown_names_rejected_with_valid_list(call):
    with pytest.raises(ValueError) as e:
        call()
    msg = str(e.value)
    assert "bogus" in msg
    assert all(name in msg for name in switches.SWITCHES)
    assert switches.state() == {n: s.default for n, s in switches.SWITCHES.items()}  # nothing half-applied


def test_parse_list():
    assert switches.parse_list(None) == []
    assert switches.parse_list("") == []
    assert switches.parse_list(" gpu_routing , row_gemv ,") == ["gpu_routing", "row_gemv"]


def test_overrides_apply_and_restore():
    switches.disable("adaptive_tile")  # state before the block is restored, not defaults
    with switches.overrides(disable=["gpu_routing"], enable=["adaptive_tile"]):
        assert not switches.is_enabled("gpu_routing")
        assert switches.is_enabled("adaptive_tile")
    assert switches.is_enabled("gpu_routing")
    assert not switches.is_enabled("adaptive_tile")


def test_overrides_accept_comma_strings():
    with switches.overrides(disable="gpu_routing,row_gemv"):
        assert not switches.is_enabled("gpu_routing") and not switches.is_enabled("row_gemv")
    assert switches.is_enabled("gpu_routing") and switches.is_enabled("row_gemv")


def test_overrides_restore_on_exception_and_undo_changes_inside():
    before = switches.state()
    with pytest.raises(RuntimeError):
        with switches.overrides(disable=["fused_qk_prep"]):
            switches.disable("register_scan")  # changed inside the block: undone too
            raise RuntimeError("boom")
    assert switches.state() == before


def test_overrides_nest():
    with switches.overrides(disable=["gpu_routing"]):
        with switches.overrides(disable=["row_gemv"], enable=["gpu_routing"]):
            assert switches.is_enabled("gpu_routing") and not switches.is_enabled("row_gemv")
        assert not switches.is_enabled("gpu_routing") and switches.is_enabled("row_gemv")
    assert switches.state() == {n: s.default for n, s in switches.SWITCHES.items()}


def test_padded_name_acts_on_the_switch_or_is_rejected():
    try:
        switches.set_enabled(" gpu_routing ", False)
    except ValueError:
        return  # rejecting is fine too
    assert not switches.is_enabled("gpu_routing")
    assert set(switches.state()) == set(switches.SWITCHES)


def test_empty_name_rejected():
    with pytest.raises(ValueError):
        switches.set_enabled("", False)
    with pytest.raises(ValueError):
        switches.is_enabled("")
