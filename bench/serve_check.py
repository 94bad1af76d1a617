"""Start a server command (``mlx_lm.server``, optionally under ``mlx.launch``), wait until it answers, send
one temperature-0 chat request per prompt, stop it, and record what came back.

Used to check ``mlx_lm.server --lily`` where no test runner goes (two GPUs under NCCL): the same
request to a lily server and to a stock server of the same checkpoint, with the completions, the token
counts and the seconds each took in one JSON file. Standard library only (urllib), so it runs on a
machine without the ``openai`` client; CI checks the server with the real client
(tests/integration/test_server.py).

    python -m bench.serve_check --out lily.json -- \\
        mlx.launch --backend nccl -n 2 -- mlx_lm.server --model DIR --port 8123 --lily
    python -m bench.serve_check --compare lily.json stock.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

DEFAULT_PROMPTS = ("Write one sentence about the sea.", "List three prime numbers.")


def port_of(command: list[str]) -> int:
    for i, part in enumerate(command[:-1]):
        if part == "--port":
            return int(command[i + 1])
    return 8080  # mlx_lm.server's default


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> float:
    """Seconds until GET /v1/models answers; raises if the server exits or the time runs out."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before answering")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5):
                return time.perf_counter() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1.0)
    raise TimeoutError(f"no answer on port {port} within {timeout:.0f} s")


def chat(port: int, prompt: str, max_tokens: int, timeout: float) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0.0, "seed": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        data = json.loads(resp.read())
    return {"prompt": prompt, "text": data["choices"][0]["message"]["content"],
            "finish_reason": data["choices"][0].get("finish_reason"), "usage": data.get("usage"),
            "seconds": round(time.perf_counter() - t0, 2)}


def stop(proc: subprocess.Popen) -> None:
    """The launcher and every rank: the server runs in its own process group."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run(command: list[str], prompts, max_tokens: int, ready_timeout: float, log_path: Path | None) -> dict:
    port = port_of(command)
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    result = {"command": " ".join(command), "answers": []}
    try:
        result["ready_s"] = round(wait_ready(port, proc, ready_timeout), 1)
        print(f"[serve_check] server ready after {result['ready_s']} s", file=sys.stderr, flush=True)
        for prompt in prompts:
            answer = chat(port, prompt, max_tokens, ready_timeout)
            print(f"[serve_check] {answer['seconds']} s, {answer['usage']}: {answer['text']!r}",
                  file=sys.stderr, flush=True)
            result["answers"].append(answer)
        result["ok"] = True
    except Exception as exc:  # recorded: the caller compares runs and reports
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[serve_check] FAILED: {result['error']}", file=sys.stderr, flush=True)
    finally:
        stop(proc)
        if log_path:
            log.close()
    return result


def compare(paths) -> int:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    texts = [[a["text"] for a in r.get("answers", [])] for r in runs]
    same = all(r.get("ok") for r in runs) and all(t == texts[0] for t in texts)
    for p, r in zip(paths, runs):
        print(f"{p}: ok={r.get('ok')} {r.get('error', '')} {[a['text'] for a in r.get('answers', [])]}")
    print(f"same completions: {same}")
    return 0 if same else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_check", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", help="a user message (repeatable; default: two short ones)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for the server")
    p.add_argument("--out", help="JSON result file (the server's log goes beside it, .log)")
    p.add_argument("--compare", nargs="+", metavar="JSON", help="no run: compare the completions of result files")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the server command")
    args = p.parse_args(argv)
    if args.compare:
        return compare(args.compare)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the server command after --")
    out = Path(args.out) if args.out else None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
    result = run(command, args.prompt or DEFAULT_PROMPTS, args.max_tokens, args.ready_timeout,
                 out.with_suffix(".log") if out else None)
    if out:
        out.write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
