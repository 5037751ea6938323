"""A client that goes away frees its row at the engine's next step boundary: on a one-row server whose request
asks 3000 tokens, the request queued behind it starts long before those 3000 steps (the engine's own step count
says so, not a clock). And a full queue answers 429 in the OpenAI error shape."""
from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from flexh2o.config import ModelConfig
from serve_helpers import client, live_server, metric, served_checkpoint, wait_for

pytest.importorskip("tokenizers")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

LONG = ModelConfig(name="tiny-long", family="opt", hidden=32, num_layers=2, num_heads=2, ffn=64, vocab=512,
                   max_positions=4096)
MAX = 3000  # the cancelled requests' max_tokens: were their rows kept, the next request would wait this many steps


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt, _ = served_checkpoint(str(tmp_path_factory.mktemp("serve-cancel")), LONG)
    off = str(tmp_path_factory.mktemp("serve-cancel-offload"))
    argv = ["--path", ckpt, "--gpu-batch-size", "1", "--prompt-len", "8", "--gen-len", str(MAX), "--offload-dir",
            off, "--no-warmup", "--ignore-eos", "--max-queue", "1"]
    with live_server(argv) as (url, _):
        yield url


def queued(url: str) -> bool:
    return metric(url, "flexh2o_queue_length") == 1


def test_a_closed_stream_frees_its_row_and_a_full_queue_is_429(server):
    steps, cancelled = metric(server, "flexh2o_steps_total"), metric(server, "flexh2o_requests_cancelled_total")
    c = client(server)
    stream = c.completions.create(model="ckpt", prompt=[5, 6, 7], max_tokens=MAX, stream=True)
    chunks = iter(stream)
    assert next(chunks).choices[0].text  # the row is generating
    with ThreadPoolExecutor(1) as pool:
        behind = pool.submit(lambda: client(server).completions.create(model="ckpt", prompt=[8, 9], max_tokens=4))
        wait_for(lambda: queued(server), what="the second request queued")
        with pytest.raises(openai.RateLimitError) as e:  # --max-queue 1: a third request is refused
            c.completions.create(model="ckpt", prompt=[1], max_tokens=2)
        assert e.value.status_code == 429 and e.value.body["code"] == "rate_limit_exceeded"
        stream.close()  # the client goes away
        answer = behind.result(timeout=120)
    assert answer.usage.completion_tokens == 4
    assert metric(server, "flexh2o_requests_cancelled_total") == cancelled + 1
    assert metric(server, "flexh2o_steps_total") - steps < MAX  # the second did not wait out the first's length


def test_a_client_gone_from_a_whole_answer_frees_its_row(server):
    """A non-streamed request whose socket closes while it runs (sent raw, so the close is ours to time)."""
    steps, cancelled = metric(server, "flexh2o_steps_total"), metric(server, "flexh2o_requests_cancelled_total")
    port = int(server.rsplit(":", 1)[1])
    body = json.dumps({"model": "ckpt", "prompt": [5, 6, 7], "max_tokens": MAX}).encode()
    raw = socket.create_connection(("127.0.0.1", port), timeout=30)
    raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    wait_for(lambda: metric(server, "flexh2o_rows_busy") == 1, what="the raw request in its row")
    with ThreadPoolExecutor(1) as pool:
        behind = pool.submit(lambda: client(server).completions.create(model="ckpt", prompt=[8, 9], max_tokens=4))
        wait_for(lambda: queued(server), what="the second request queued")
        raw.close()
        assert behind.result(timeout=120).usage.completion_tokens == 4
    assert metric(server, "flexh2o_requests_cancelled_total") == cancelled + 1
    assert metric(server, "flexh2o_steps_total") - steps < MAX
    assert httpx.get(server + "/health", timeout=10).status_code == 200
