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
    """Three streams at once: MLX-LM batches them (B > 1) through the patched model."""
    lily = servers["lily"]
    prompts = [[{"role": "user", "content": text}] for text in
               ("Return a shallow copy.", "Explain nested values in a long sentence.", "Why?")]
    results = [None] * len(prompts)

    def run(i):
        results[i] = lily.stream_chat(prompts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    for text, finish in results:
        assert finish in ("stop", "length")
        assert text is not None
    assert lily.proc.poll() is None  # still serving
