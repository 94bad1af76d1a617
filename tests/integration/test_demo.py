"""The README's quick start, run the way a user runs it, and the claims docs/embedded-model.md makes
about its prompt.

The command and its expected output are read from README.md's Quick start section (not copied here):
the command runs in a shell as a real process, with ``--lily`` (reference backend, then the CPU
simulator of the Metal kernels) and without it, and must print exactly the text the README shows,
stopped by the end-of-sequence token before ``--max-tokens``. The prompt's greedy continuation must
have, at every generated position, a top-1 vs top-2 logit margin of at least the threshold that
docs/embedded-model.md states, so rounding differences between backends cannot change the tokens.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import generated_text, subprocess_env

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
EMBEDDED_DOC = ROOT / "docs" / "embedded-model.md"
INSTALL = "python -m pip install . && "


def quick_start() -> tuple[str, str]:
    """(the ``mlx_lm.generate`` command, the output block shown below it) from README's Quick start."""
    text = README.read_text()
    section = re.search(r"^## Quick start\n(.*?)^## ", text, re.S | re.M)
    assert section, "README.md has no '## Quick start' section"
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", section.group(1), re.S | re.M)
    commands = [b.strip() for b in blocks if "mlx_lm.generate" in b]
    assert len(commands) == 1, f"expected one mlx_lm.generate command in the Quick start: {commands}"
    command = commands[0]
    assert command.startswith(INSTALL), command
    outputs = [b for b in blocks if b.startswith("==========\n")]
    assert outputs, "README.md's Quick start shows no expected output (a block starting '==========')"
    return command[len(INSTALL):], outputs[0]


def option(command: str, name: str) -> str:
    argv = shlex.split(command)
    return argv[argv.index(name) + 1]


def generation_tokens(output: str) -> int:
    found = re.search(r"^Generation: (\d+) tokens", output, re.M)
    assert found, f"no 'Generation: N tokens' line in:\n{output}"
    return int(found.group(1))


def run_shell(command: str, backend: str, cwd: Path) -> subprocess.CompletedProcess:
    """``command`` in bash, with this interpreter's ``python`` and ``mlx_lm.generate`` first on PATH."""
    env = subprocess_env()
    env["LILY_BACKEND"] = backend
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


@pytest.mark.parametrize("lily,backend", [(True, "reference"), (True, "sim"), (False, "reference")],
                         ids=["lily-reference", "lily-sim", "stock"])
def test_readme_quick_start_prints_the_output_it_shows(installed_hook, tmp_path, lily, backend):
    if backend == "sim":
        from lily_mlx.msl.sim import build

        try:
            build.compiler()
        except build.CompileError as e:  # the simulator's one precondition
            pytest.skip(f"no C++ compiler for the simulator: {e}")
    command, expected = quick_start()
    if not lily:  # "Drop `--lily` to run stock MLX-LM on the same model."
        assert command.count(" --lily ") == 1, command
        command = command.replace(" --lily ", " ")
    proc = run_shell(command, backend, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if lily:
        assert "model patched" in proc.stderr and f"backend {backend}" in proc.stderr, proc.stderr
    else:
        assert "model patched" not in proc.stderr, proc.stderr

    text = generated_text(proc.stdout)
    assert "<|endoftext|>" not in text and "<|im_end|>" not in text, text
    assert text == generated_text(expected), f"printed:\n{proc.stdout}\nREADME shows:\n{expected}"
    # Stopped by the end-of-sequence token (counted in 'Generation'), not by --max-tokens.
    n = generation_tokens(proc.stdout)
    assert n == generation_tokens(expected) and n < int(option(command, "--max-tokens")), proc.stdout


def margin_threshold() -> float:
    found = re.search(r"top-1 vs top-2 logit margin of at least \*\*([0-9.]+)\*\*",
                      EMBEDDED_DOC.read_text())
    assert found, "docs/embedded-model.md states no demo margin threshold"
    return float(found.group(1))


def test_demo_prompt_has_clear_greedy_margins():
    """Stock MLX-LM, greedy, on the README's prompt: every generated token (the end-of-sequence token
    included) beats the runner-up by at least the documented margin; the text is the README's."""
    mx = pytest.importorskip("mlx.core")
    import mlx_lm
    from mlx_lm.generate import generate_step

    from lily_mlx.models import embedded

    command, expected = quick_start()
    assert "--ignore-chat-template" in shlex.split(command)  # the prompt is continued as plain text
    prompt = option(command, "--prompt").replace("\\n", "\n")  # as mlx_lm.generate reads it
    max_tokens = int(option(command, "--max-tokens"))
    model, tokenizer = mlx_lm.load(str(embedded.EMBEDDED_DIR))

    threshold = margin_threshold()
    tokens, margins = [], []
    for token, logprobs in generate_step(mx.array(tokenizer.encode(prompt)), model,
                                         max_tokens=max_tokens):
        top2 = mx.topk(logprobs.astype(mx.float32), 2).tolist()
        margins.append(abs(top2[0] - top2[1]))  # log-probabilities: same differences as logits
        tokens.append(int(token))
        if tokens[-1] in tokenizer.eos_token_ids:
            break
    assert tokens[-1] in tokenizer.eos_token_ids, "no end-of-sequence token within --max-tokens"
    assert min(margins) >= threshold, [round(m, 3) for m in margins]
    assert tokenizer.decode(tokens[:-1]) == generated_text(expected).rstrip("\n")
