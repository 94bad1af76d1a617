"""lily_mlx.core.backend: LILY_BACKEND values, automatic choice, errors."""

import pytest

from lily_mlx.core import backend


@pytest.fixture
def machine(monkeypatch):
    """Pretend this machine has (or lacks) a Metal / CUDA GPU."""
    def set_machine(metal=False, cuda=False):
        monkeypatch.setattr(backend, "_metal_available", lambda: metal)
        monkeypatch.setattr(backend, "_cuda_available", lambda: cuda)
    monkeypatch.delenv("LILY_BACKEND", raising=False)
    return set_machine


def test_choices():
    assert backend.BACKENDS == ("metal", "cuda", "sim", "reference")
    assert backend.CHOICES == ("auto",) + backend.BACKENDS


@pytest.mark.parametrize("metal,cuda,expected", [
    (True, True, "metal"), (True, False, "metal"), (False, True, "cuda"), (False, False, "reference"),
])
def test_auto_prefers_metal_then_cuda_then_reference(machine, monkeypatch, metal, cuda, expected):
    machine(metal=metal, cuda=cuda)
    assert backend.auto_backend() == expected
    assert backend.resolve_backend() == expected  # unset means auto
    for value in ("auto", "AUTO", " auto ", ""):
        monkeypatch.setenv("LILY_BACKEND", value)
        assert backend.resolve_backend() == expected


def test_sim_is_never_automatic(machine):
    machine()
    assert backend.auto_backend() != "sim"


@pytest.mark.parametrize("value", ["sim", "reference", "Reference", " sim "])
def test_always_available_backends(machine, monkeypatch, value):
    machine()
    monkeypatch.setenv("LILY_BACKEND", value)
    assert backend.resolve_backend() == value.strip().lower()


def test_requested_argument_overrides_env(machine, monkeypatch):
    machine(metal=True)
    monkeypatch.setenv("LILY_BACKEND", "sim")
    assert backend.resolve_backend("reference") == "reference"
    assert backend.resolve_backend() == "sim"


@pytest.mark.parametrize("value", ["metal", "cuda"])
def test_unavailable_gpu_backend_is_an_error(machine, monkeypatch, value):
    machine()
    monkeypatch.setenv("LILY_BACKEND", value)
    with pytest.raises(RuntimeError, match=value):
        backend.resolve_backend()
    with pytest.raises(RuntimeError):
        backend.resolve_backend(value)


def test_available_gpu_backends(machine, monkeypatch):
    machine(metal=True, cuda=True)
    assert backend.resolve_backend("metal") == "metal"
    assert backend.resolve_backend("cuda") == "cuda"


@pytest.mark.parametrize("value", ["gpu", "cpu", "metal,cuda", "mps"])
def test_invalid_value_lists_choices(machine, monkeypatch, value):
    machine()
    monkeypatch.setenv("LILY_BACKEND", value)
    with pytest.raises(ValueError) as e:
        backend.resolve_backend()
    assert all(c in str(e.value) for c in backend.CHOICES)


def test_real_probes_do_not_raise():
    """On any machine the probes answer a bool (no GPU here: both False on a CPU-only CI)."""
    assert isinstance(backend._metal_available(), bool)
    assert isinstance(backend._cuda_available(), bool)
    assert backend.auto_backend() in ("metal", "cuda", "reference")
