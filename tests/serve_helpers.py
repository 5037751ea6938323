"""Shared pieces of the server tests: a tiny OPT checkpoint with a word-level tokenizer and a chat template kept
beside it, a server run in this process on a free loopback port (ready once /health answers), and clients."""
from __future__ import annotations

import contextlib
import os
import threading
import time

import httpx

from request_helpers import write_checkpoint, write_tokenizer

# words only, so the word-level tokenizer encodes every rendered conversation (w1: a user turn, w2: another role)
TEMPLATE = ("{% for m in messages %}{{ 'w1' if m['role'] == 'user' else 'w2' }} {{ m['content'] }} w3 {% endfor %}"
            "{% if add_generation_prompt %}w4{% endif %}")
READY_S = 60  # the engine is built before the socket serves; a tiny model's takes a second or two


def served_checkpoint(root: str, cfg=None) -> tuple:
    """(checkpoint folder holding tokenizer.json and chat_template.jinja, its weights with Hugging Face names)."""
    ckpt = os.path.join(root, "ckpt")
    weights = write_checkpoint(ckpt, cfg) if cfg is not None else write_checkpoint(ckpt)
    write_tokenizer(os.path.join(ckpt, "tokenizer.json"), (cfg.vocab if cfg is not None else 512))
    with open(os.path.join(ckpt, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    return ckpt, weights


def wait_ready(url: str, timeout: float = READY_S, proc=None) -> None:
    """Poll /health until it answers 200 (bounded); a server process that exits first fails at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{url}/health did not answer within {timeout} s")


@contextlib.contextmanager
def live_server(argv: list, stop_timeout: float = 60):
    """(base url, Server) of flexh2o-serve `argv` run in this process on a free port of 127.0.0.1."""
    from flexh2o.cli import serve as cli
    prepared = cli.prepare(argv + ["--port", "0", "--stats-interval", "0"])
    sock = cli.bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        with cli.opened(prepared) as server:
            runner = server.uvicorn()
            thread = threading.Thread(target=runner.run, kwargs={"sockets": [sock]}, daemon=True)
            thread.start()
            try:
                wait_ready(url)
                yield url, server
            finally:
                runner.should_exit = True
                thread.join(stop_timeout)
            assert not thread.is_alive(), "the server did not stop"
    finally:
        sock.close()


def client(url: str, api_key: str = "none", timeout: float = 60):
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)


def metric(url: str, name: str) -> float:
    """One value of /metrics (Prometheus text) by its full name."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"/metrics has no {name}")


def wait_for(cond, timeout: float = 30, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what} did not hold within {timeout} s")
