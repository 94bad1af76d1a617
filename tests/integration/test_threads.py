"""lily-mlx used from another thread than the one that imported it, as MLX-LM's server does (it generates in a thread
of its own, with its own stream): an MLX array not yet evaluated belongs to the stream of the thread that made it,
and evaluating it from another thread fails ("There is no Stream(cpu, 0) in current thread"). Each check runs in a
fresh process, where nothing has been evaluated in the main thread before."""

import subprocess
import sys

from .conftest import subprocess_env

# Every lily module's module-level arrays (alone or in a dict), evaluated in a new thread after the import.
_CONSTANTS = """
import sys, threading, types
import mlx.core as mx
import importlib, pkgutil
import lily_mlx
import lily_mlx.ops
for info in pkgutil.walk_packages(lily_mlx.ops.__path__, "lily_mlx.ops."):
    importlib.import_module(info.name)
found, failed = [], []
for name, module in list(sys.modules.items()):
    if not name.startswith("lily_mlx") or not isinstance(module, types.ModuleType):
        continue
    for attr, value in vars(module).items():
        values = value.values() if isinstance(value, dict) else [value]
        arrays = [v for v in values if isinstance(v, mx.array)]
        if arrays:
            found.append(f"{name}.{attr}")
            def evaluate(arrays=arrays, label=f"{name}.{attr}"):
                try:
                    with mx.stream(mx.new_stream(mx.default_device())):
                        mx.eval([a + 0 for a in arrays])
                except Exception as e:
                    failed.append(f"{label}: {e}")
            t = threading.Thread(target=evaluate)
            t.start()
            t.join()
print("found", len(found), "failed", failed)
"""

# lily_mlx.load in the main thread, then generation in a worker thread with its own stream: a batch with its prompt
# caches returned, then one sequence continued from its cache (the server's prompt-cache hit), on the simulator.
_SERVE_IN_A_THREAD = """
import sys, threading
import mlx.core as mx
import lily_mlx
from lily_mlx.models.embedded import EMBEDDED_DIR
from mlx_lm import batch_generate, stream_generate
model, tok = lily_mlx.load(str(EMBEDDED_DIR))
prompt = "Return a new dictionary with the keys of the mapping and values set to"
result = []
def work():
    try:
        stream = mx.new_stream(mx.default_device())
        with mx.stream(stream):
            batch = batch_generate(model, tok, [tok.encode(prompt)], max_tokens=3, return_prompt_caches=True)
            more = [r.text for r in stream_generate(model, tok, tok.encode(" the"), max_tokens=4,
                                                    prompt_cache=batch.caches[0], stream=stream)]
        result.append(batch.texts[0] + "".join(more))
    except Exception as e:
        result.append(f"FAILED {type(e).__name__}: {e}")
t = threading.Thread(target=work)
t.start()
t.join()
print("RESULT", repr(result[0]))
"""


def _run(code: str, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(subprocess_env(), **env))


def test_module_constants_evaluate_in_any_thread():
    done = _run(_CONSTANTS, LILY_BACKEND="sim")
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.endswith("failed []"), line
    assert int(line.split()[1]) >= 4  # the kernels' stand-in inputs are among them


def test_generation_in_a_thread_of_its_own_after_loading_in_the_main_thread():
    """What MLX-LM's server does with a prompt-cache hit, on the simulated kernels (the crash: the decode attention
    kernel's stand-in input, made at import in the main thread, first evaluated in the generation thread)."""
    done = _run(_SERVE_IN_A_THREAD, LILY_BACKEND="sim")
    assert done.returncode == 0, done.stderr[-3000:]
    result = done.stdout.strip().splitlines()[-1]
    assert result.startswith("RESULT") and "FAILED" not in result and len(result) > len("RESULT ''"), result
