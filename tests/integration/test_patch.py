"""lily_mlx.patch / unpatch / load on whole MLX-LM models: token-identical to stock on the reference
backend (greedy, 100 tokens), for every switch flipped, and for every supported architecture."""

from __future__ import annotations

import warnings

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

import lily_mlx
from lily_mlx import patch as lily_patch
from lily_mlx.core import projections
from lily_mlx.core import switches

from .conftest import PROMPT

N_TOKENS = 100


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", "reference")
    monkeypatch.delenv("LILY_DISABLE", raising=False)
    monkeypatch.delenv("LILY_ENABLE", raising=False)
    switches.reset()
    yield
    switches.reset()


def greedy_tokens(model, tokenizer, n=N_TOKENS, **kwargs):
    prompt = mx.array(tokenizer.encode(PROMPT))
    return [int(t) for t, _ in generate_step(prompt, model, max_tokens=n, **kwargs)]


def logits(model, tokenizer):
    return model(mx.array(tokenizer.encode(PROMPT))[None])


def stock_classes(model):
    return [type(m) for m in model.modules()]


@pytest.fixture(scope="module")
def stock_tokens(loaded_model):
    m, tok = loaded_model
    return greedy_tokens(m, tok)


@pytest.fixture
def model(loaded_model):
    m, tok = loaded_model
    yield m, tok
    lily_mlx.unpatch(m)


def test_patched_equals_stock_100_tokens(model, stock_tokens):
    m, tok = model
    stock = greedy_tokens(m, tok)
    assert stock == stock_tokens  # stock is deterministic
    lily_mlx.patch(m)
    assert lily_mlx.is_patched(m)
    assert greedy_tokens(m, tok) == stock
    assert len(stock) == N_TOKENS


@pytest.mark.parametrize("name", list(switches.SWITCHES))
def test_each_switch_off_still_identical(model, stock_tokens, name):
    """Reference backend (this module's default): every switch state is still exactly stock (only
    chunked_prefill changes anything here: the chunk size). The kernels each state runs, on the
    simulator: tests/kernels/test_switch_paths.py."""
    m, tok = model
    lily_mlx.patch(m)
    with switches.overrides(disable=[name]):
        # chunked_prefill acts through the prompt chunk size MLX-LM is given
        lily = greedy_tokens(m, tok, prefill_step_size=lily_patch.prefill_step_size())
    assert lily == stock_tokens


def test_patch_swaps_only_target_layers_and_unpatch_restores(model):
    m, tok = model
    before_classes = stock_classes(m)
    before_params = dict(tree_flatten(m.parameters()))
    stock_logits = logits(m, tok)

    lily_mlx.patch(m)
    lily_mlx.patch(m)  # idempotent
    guarded = [x for x in m.modules() if type(x).__dict__.get("_lily_watch_only")]
    for x in guarded:  # the rest of the tree: stock's code, under a class that refuses adapters (lily_mlx.patch)
        assert type(x).__call__ is type(x)._lily_stock_class.__call__ and type(x).__name__.endswith("Guarded")
    assert guarded and type(m) in {type(x) for x in guarded}
    guarded_ids = {id(x) for x in guarded}
    swapped = {type(x).__name__ for x in m.modules() if type(x) not in before_classes and id(x) not in guarded_ids}
    assert swapped <= {"LilyGatedDeltaNet", "LilyQwen3NextGatedDeltaNet", "LilyQwen3NextAttention",
                       "LilyQwen3NextSparseMoeBlock", "LilyDecoderLayer", "LilyQwen3NextDecoderLayer",
                       "LilyQuantizedLinear", "LilyTextModel", "LilyModel"}
    assert "LilyQwen3NextAttention" in swapped
    for mod in m.modules():  # a lily class is a subclass of the stock one: isinstance still holds
        if type(mod).__name__.startswith("Lily"):
            assert isinstance(mod, type(mod)._lily_stock_class)

    lily_mlx.unpatch(m)
    assert not lily_mlx.is_patched(m)
    assert stock_classes(m) == before_classes
    # Same weights: the same arrays, except a layer's fused projections (lily_mlx.core.projections), which
    # now hold views of one concatenation with the same values, shapes and dtypes.
    after = dict(tree_flatten(m.parameters()))
    assert after.keys() == before_params.keys()
    fused_names = {name for group in projections.GROUPS.values() for name in group}
    for k, v in after.items():
        if v is not before_params[k]:
            assert k.split(".")[-2] in fused_names, k
            assert v.dtype == before_params[k].dtype and mx.array_equal(v, before_params[k]).item(), k
    assert mx.array_equal(logits(m, tok), stock_logits).item()


def test_engines_alternate_in_one_process(model):
    m, tok = model
    stock = greedy_tokens(m, tok, n=20)
    for _ in range(2):
        lily_mlx.patch(m)
        assert greedy_tokens(m, tok, n=20) == stock
        lily_mlx.unpatch(m)
        assert greedy_tokens(m, tok, n=20) == stock


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
def test_other_supported_architectures(random_model, model_type):
    import mlx_lm

    m, tok = mlx_lm.load(str(random_model(model_type)))
    stock = greedy_tokens(m, tok, n=40)
    lily_mlx.patch(m)
    assert lily_mlx.is_patched(m)
    assert greedy_tokens(m, tok, n=40) == stock
    lily_mlx.unpatch(m)
    assert not lily_mlx.is_patched(m)


def test_load_is_a_drop_in(model_path):
    import mlx_lm

    m, tok = lily_mlx.load(str(model_path))
    assert lily_mlx.is_patched(m)
    m2, tok2, config = lily_mlx.load(str(model_path), return_config=True)
    stock, stock_tok, stock_config = mlx_lm.load(str(model_path), return_config=True)
    assert config == stock_config
    assert type(tok2) is type(stock_tok)
    assert greedy_tokens(m2, tok2, n=30) == greedy_tokens(stock, stock_tok, n=30)


def _tiny_llama():
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=1,
                           intermediate_size=64, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=64, num_key_value_heads=4)
    return llama.Model(args)


def test_unsupported_model_type_is_a_clear_error():
    model = _tiny_llama()
    with pytest.raises(ValueError) as err:
        lily_mlx.patch(model)
    msg = str(err.value)
    assert "'llama'" in msg
    for name in lily_mlx.SUPPORTED_MODEL_TYPES:
        assert name in msg
    assert not lily_mlx.is_patched(model)


def test_unsupported_model_type_non_strict_warns_and_keeps_stock():
    model = _tiny_llama()
    classes = stock_classes(model)
    with pytest.warns(UserWarning, match="does not support model type 'llama'"):
        out = lily_mlx.patch(model, strict=False)
    assert out is model
    assert stock_classes(model) == classes


def test_untested_versions_refused_unless_allowed(model, monkeypatch):
    m, _ = model
    monkeypatch.setattr(lily_patch, "installed_versions", lambda: {"mlx": "0.32.4", "mlx-lm": "0.33.0"})
    monkeypatch.delenv("LILY_ALLOW_UNTESTED", raising=False)
    with pytest.raises(RuntimeError, match=r"mlx-lm 0\.33\.0 \(tested >=0\.32\.2,<0\.33\)"):
        lily_mlx.patch(m)
    assert not lily_mlx.is_patched(m)
    monkeypatch.setenv("LILY_ALLOW_UNTESTED", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lily_mlx.patch(m)
    assert lily_mlx.is_patched(m)


def _prefill_and_step(model, tokenizer):
    """The prompt's logits after a prefill and one decode step over a fresh cache (the kernels' caches, decode plans
    and traces are made in the modules on the way)."""
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.array(tokenizer.encode(PROMPT))[None]
    cache = make_prompt_cache(model)
    model(prompt, cache=cache)
    return model(prompt[:, -1:], cache=cache)


def test_a_patched_model_copies_and_pickles_after_it_ran(model, monkeypatch):
    """copy.deepcopy and pickle of a patched model that has run its kernels (caches keyed by dtype, decode plans and
    traces in its modules' __dict__) work as for a stock model: the copy is patched, computes the same logits, and
    leaves the original's caches behind."""
    import copy
    import pickle

    monkeypatch.setenv("LILY_BACKEND", "sim")
    m, tok = model
    lily_mlx.patch(m)
    want = _prefill_and_step(m, tok)
    mx.eval(want)
    assert any(k.startswith("_lily_moe") for x in m.modules() for k in vars(x))  # the kernels' caches are there
    for copied in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert lily_mlx.is_patched(copied)
        assert not any(k.startswith("_lily_moe") for x in copied.modules() for k in vars(x))
        assert mx.array_equal(_prefill_and_step(copied, tok), want)


_LOAD_AND_STEP = """
import pickle, sys
import mlx.core as mx, numpy as np
from mlx_lm.models.cache import make_prompt_cache
model = pickle.load(open(sys.argv[1], "rb"))  # no lily_mlx import before: the pickle brings it
import lily_mlx
assert lily_mlx.is_patched(model)
prompt = mx.array(np.load(sys.argv[2]))
cache = make_prompt_cache(model)
model(prompt, cache=cache)
out = model(prompt[:, -1:], cache=cache).astype(mx.float32)
assert mx.array_equal(out, mx.array(np.load(sys.argv[3]))).item(), "other logits"
print("loaded and equal")
"""


def test_a_patched_model_pickled_loads_in_a_fresh_process(model, tmp_path, monkeypatch):
    """A patched model's pickle loads in a process that never patched anything (lily classes are made by patch(),
    so the pickle names what each is made from) and computes the same logits; pickles of two architectures whose
    lily classes share a name (qwen3_5's and qwen3_5_moe's ``Model``) both load."""
    import pickle
    import subprocess
    import sys

    import numpy as np

    from .conftest import subprocess_env

    monkeypatch.setenv("LILY_BACKEND", "sim")
    m, tok = model
    lily_mlx.patch(m)
    want = _prefill_and_step(m, tok).astype(mx.float32)
    (tmp_path / "m.pkl").write_bytes(pickle.dumps(m))
    np.save(tmp_path / "prompt.npy", np.array(mx.array(tok.encode(PROMPT))[None]))
    np.save(tmp_path / "want.npy", np.array(want))
    env = dict(subprocess_env(), LILY_BACKEND="sim")
    done = subprocess.run([sys.executable, "-c", _LOAD_AND_STEP] + [str(tmp_path / f) for f in ("m.pkl", "prompt.npy",
                          "want.npy")], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and "loaded and equal" in done.stdout, done.stderr[-3000:]


def test_two_architectures_pickle_in_one_process(random_model):
    import pickle

    import mlx_lm

    models = [mlx_lm.load(str(random_model(t)))[0] for t in ("qwen3_5", "qwen3_5_moe")]
    try:
        for m in models:
            lily_mlx.patch(m)
        assert type(models[0]).__name__ == type(models[1]).__name__  # LilyModelGuarded, of two stock classes
        for m in models:
            for protocol in (2, pickle.HIGHEST_PROTOCOL):
                copied = pickle.loads(pickle.dumps(m, protocol=protocol))
                assert lily_mlx.is_patched(copied) and type(copied) is type(m)
                assert len(tree_flatten(copied.parameters())) == len(tree_flatten(m.parameters()))
            with pytest.raises(TypeError, match="cannot pickle"):  # as stock: protocol 1 cannot hold MLX arrays
                pickle.dumps(m, protocol=1)
    finally:
        for m in models:
            lily_mlx.unpatch(m)


def test_an_unpatched_model_copies_and_pickles_with_nothing_of_lily_left(model, monkeypatch):
    """unpatch() after the kernels ran: no lily attribute or class is left in the tree, and the model deep-copies and
    pickles as a stock model does (the kernels' caches, keyed by mx.Dtype, went with the classes)."""
    import copy
    import pickle

    monkeypatch.setenv("LILY_BACKEND", "sim")
    m, tok = model
    lily_mlx.patch(m)
    mx.eval(_prefill_and_step(m, tok))
    lily_mlx.unpatch(m)
    assert not [k for x in m.modules() for k in vars(x) if k.startswith("_lily_")]
    assert not [type(x) for x in m.modules() if type(x).__module__.startswith("lily_mlx")]
    for copied in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert not lily_mlx.is_patched(copied)


@pytest.mark.parametrize("reporting", [None, "constant_weights", "step_trace"])
def test_patching_leaves_modules_shared_with_other_models_stock(model, loaded_model, model_path, reporting):
    """MLX-LM's SwitchGLU takes one default SwiGLU() instance for every model of the process: patching one model
    must not give it (or any other leaf) a lily class, so a stock model loaded beside it stays stock; also with the
    switches whose modules report weight changes (a leaf without arrays has none to report)."""
    import mlx_lm

    other, _ = mlx_lm.load(str(model_path))
    m, _ = model
    with switches.overrides(enable=[reporting] if reporting else []):
        lily_mlx.patch(m)
    assert not [type(x).__name__ for x in other.modules() if type(x).__module__.startswith("lily_mlx")]
    # leaves of the patched model: none guarded; with a reporting switch those with arrays report (theirs alone)
    watched = [x for x in m.modules() if not x.children() and type(x).__dict__.get("_lily_watch_only")]
    assert all(reporting and x.parameters() for x in watched), [type(x).__name__ for x in watched]


def test_installed_versions_are_in_the_tested_range():
    assert lily_patch.untested_versions() == []


def test_missing_op_keeps_stock_call():
    assert lily_patch._op_forward("no_such_family", "forward") is None
    cls = lily_patch._lily_class(nn.Linear, None)
    assert cls.__call__ is nn.Linear.__call__ and cls._lily_stock_class is nn.Linear


def test_prefill_step_size_follows_chunked_prefill():
    assert lily_patch.prefill_step_size() == 2048
    assert lily_patch.prefill_step_size(512) == 512
    with switches.overrides(disable=["chunked_prefill"]):
        assert lily_patch.prefill_step_size(512) >= 2**31


def test_chunked_prefill_off_matches_chunked_stock_on_a_long_prompt(model):
    """The switch only matters for prompts longer than a chunk: stock chunked by 32 vs lily with the
    whole ~200-token prompt in one chunk (same tokens on the test models; the switch contract allows
    rounding differences, which greedy decoding of these models does not hit)."""
    m, tok = model
    prompt = mx.array(tok.encode(open(switches.__file__).read()[:400]))
    assert prompt.size > 4 * 32

    def run():
        step = lily_patch.prefill_step_size(32)
        return [int(t) for t, _ in generate_step(prompt, m, max_tokens=10, prefill_step_size=step)]

    stock = run()
    lily_mlx.patch(m)
    with switches.overrides(disable=["chunked_prefill"]):
        assert lily_patch.prefill_step_size(32) > prompt.size
        assert run() == stock


def test_config_alias_of_a_supported_architecture(model_path, tmp_path, monkeypatch):
    """A model_type that MLX-LM remaps (MODEL_REMAPPING) to a supported architecture is supported:
    patch() recognises the architecture module the model was built from."""
    import json
    import shutil

    import mlx_lm
    from mlx_lm import utils as mlx_lm_utils

    alias_dir = tmp_path / "alias"
    shutil.copytree(model_path, alias_dir)
    config = json.loads((alias_dir / "config.json").read_text())
    arch = config["model_type"]
    config["model_type"] = "lily_test_alias"
    (alias_dir / "config.json").write_text(json.dumps(config))
    monkeypatch.setitem(mlx_lm_utils.MODEL_REMAPPING, "lily_test_alias", arch)

    m, tok = mlx_lm.load(str(alias_dir))
    stock = greedy_tokens(m, tok, n=10)
    lily_mlx.patch(m)
    assert lily_mlx.is_patched(m)
    assert greedy_tokens(m, tok, n=10) == stock
