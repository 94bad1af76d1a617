"""``mlx_lm.server --lily`` on 127.0.0.1, answered through a real ``openai`` client.

A lily server and a stock server run side by side on the test model; greedy requests (chat,
completion, streaming) get the same text from both, and concurrent streams exercise MLX-LM's batched
generator (B > 1) on the patched model. A bounded number of requests, each with a timeout.
"""

from __future__ import annotations

import subprocess
import threading
import time
import urllib.request

import pytest

from .conftest import free_port, mlx_lm_command, subprocess_env

openai = pytest.importorskip("openai", reason="the openai client is in the test extras")

MESSAGES = [{"role": "user", "content": "Return a shallow copy of the mapping."}]
MAX_TOKENS = 24
START_TIMEOUT = 120


class Server:
    def __init__(self, model_path, tmp_path, lily: bool):
        self.port = free_port()
        self.log_path = tmp_path / f"server-{'lily' if lily else 'stock'}.log"
        cmd = mlx_lm_command("server") + ["--model", str(model_path), "--host", "127.0.0.1",
                                          "--port", str(self.port)]
        if lily:
            cmd.append("--lily")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=subprocess_env(), cwd=tmp_path)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none",
                                    max_retries=0, timeout=120)

    def wait_ready(self):
        deadline = time.time() + START_TIMEOUT
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(f"server did not start in {START_TIMEOUT} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def chat(self, **kwargs):
        return self.client.chat.completions.create(
            model="default_model", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0,
            **kwargs)

    def stream_chat(self, messages=MESSAGES):
        chunks = self.client.chat.completions.create(
            model="default_model", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0,
            stream=True)
        parts, finish = [], None
        for chunk in chunks:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish


@pytest.fixture(scope="module")
def servers(installed_hook, model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    started = {"lily": Server(model_path, tmp, lily=True), "stock": Server(model_path, tmp, lily=False)}
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.mark.slow  # two server processes and a dozen requests on a shared CPU
def test_server_lily_answers_openai_client_like_stock(servers):
    lily, stock = servers["lily"], servers["stock"]

    lily_chat, stock_chat = lily.chat(), stock.chat()
    assert lily_chat.choices[0].message.content == stock_chat.choices[0].message.content
    assert lily_chat.choices[0].message.content
    assert lily_chat.usage.completion_tokens == stock_chat.usage.completion_tokens

    lily_stream, finish = lily.stream_chat()
    assert finish in ("stop", "length")
    assert lily_stream == lily_chat.choices[0].message.content  # streaming = non-streaming

    lily_completion = lily.client.completions.create(
        model="default_model", prompt="Return the value of", max_tokens=MAX_TOKENS, temperature=0.0)
    stock_completion = stock.client.completions.create(
        model="default_model", prompt="Return the value of", max_tokens=MAX_TOKENS, temperature=0.0)
    assert lily_completion.choices[0].text == stock_completion.choices[0].text

    assert "model patched" in lily.log()
    assert "model patched" not in stock.log()


@pytest.mark.slow
def test_server_lily_concurrent_streams(servers):
    """Three streams at once: MLX-LM batches them (B > 1) through the patched model (reference
    backend). Each stream's temperature-0 answer is the one the same request gets alone, from lily
    and from stock (the reference backend is stock's computation, and stock on the CPU is batch
    invariant on this model: tests/kernels/test_batch_invariance.py)."""
    lily, stock = servers["lily"], servers["stock"]
    prompts = [[{"role": "user", "content": text}] for text in
               ("Return a shallow copy.", "Explain nested values in a long sentence.", "Why?")]
    results = [None] * len(prompts)

    def run(i):
        try:
            results[i] = lily.stream_chat(prompts[i])
        except Exception as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert all(isinstance(r, tuple) for r in results), results
    for i, (text, finish) in enumerate(results):
        assert finish in ("stop", "length")
        alone, _ = lily.stream_chat(prompts[i])
        stock_alone, _ = stock.stream_chat(prompts[i])
        assert alone, f"request {i}: empty answer"
        assert text == alone, f"request {i}: concurrent {text!r}, alone {alone!r}"
        assert alone == stock_alone, f"request {i}: lily {alone!r}, stock {stock_alone!r}"
    assert lily.proc.poll() is None  # still serving


# Batch invariance under load, kernels on: the simulator backend in the server process. Prompts of
# mixed lengths; "def f" is 2 tokens, so its prefill chunk is 1 token alone and padded to the longest
# chunk in a batch. Greedy answers must not depend on which other requests share the batch.
LOAD_PROMPTS = ["def fibonacci(n):", "def f", "Why?", "for i in range(", "import os\nimport sys\n\ndef main():",
                "Return a new dictionary with the keys of the mapping and values set to", "class Node:",
                "Return the number of", "def g", "x = [i * i for i in range(10)]"]
LOAD_CHATS = ["Return a shallow copy.", "Explain nested values in a long sentence.", "Why?",
              "Write a function that adds two numbers.", "What is a dictionary?", "Sort a list."]
LOAD_MAX_TOKENS = 16


@pytest.mark.slow  # a server on the CPU simulator; ~30 s on one core
def test_server_answers_do_not_depend_on_load_with_kernels_on(installed_hook, model_path, tmp_path, monkeypatch):
    """``mlx_lm.server --lily`` with ``LILY_BACKEND=sim`` (kernels on, simulated): 16 concurrent
    temperature-0 requests (10 completions, 6 chats) get exactly the text each gets alone. At least
    half of the streams must have been in flight together (the server's one generator: one batch)."""
    import sys

    def sim_env(base=subprocess_env):
        return {**base(), "LILY_BACKEND": "sim"}

    monkeypatch.setattr(sys.modules[__name__], "subprocess_env", sim_env)
    server = Server(model_path, tmp_path, lily=True)

    def request(i):
        """(text, time of the first and of the last streamed chunk) of request i."""
        common = dict(model="default_model", max_tokens=LOAD_MAX_TOKENS, temperature=0.0, stream=True)
        if i < len(LOAD_PROMPTS):
            chunks = server.client.completions.create(prompt=LOAD_PROMPTS[i], **common)
            texts = ((c.choices[0].text if c.choices else "") for c in chunks)
        else:
            messages = [{"role": "user", "content": LOAD_CHATS[i - len(LOAD_PROMPTS)]}]
            chunks = server.client.chat.completions.create(messages=messages, **common)
            texts = (((c.choices[0].delta.content or "") if c.choices else "") for c in chunks)
        parts, times = [], []
        for text in texts:
            parts.append(text or "")
            times.append(time.monotonic())
        return "".join(parts), times[0], times[-1]

    n = len(LOAD_PROMPTS) + len(LOAD_CHATS)
    try:
        server.wait_ready()
        concurrent = [None] * n

        def run(i):
            try:
                concurrent[i] = request(i)
            except Exception as e:  # noqa: BLE001 - reported below
                concurrent[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        alone = [request(i) for i in range(n)]
        assert server.proc.poll() is None, server.log()
    finally:
        server.stop()
    errors = [r for r in concurrent if not isinstance(r, tuple)]
    assert not errors, errors
    assert "model patched" in server.log_path.read_text()
    # Most streams were in flight at one instant, so the server's one generator ran them as a batch.
    in_flight = max(sum(first <= t <= last for _, first, last in concurrent) for _, t, _ in concurrent)
    assert in_flight >= n // 2, concurrent
    assert all(text for text, _, _ in alone), alone
    differ = [f"request {i}: under load {concurrent[i][0]!r}, alone {alone[i][0]!r}"
              for i in range(n) if concurrent[i][0] != alone[i][0]]
    assert not differ, f"{len(differ)} of {n} answers depend on the load:\n" + "\n".join(differ)
