"""flexh2o-serve's refusals, each in the OpenAI error shape {"error": {"message", "type", "param", "code"}}: a bad
request (400, one message naming the field), a request beyond the plan's lengths (400), no or a wrong API key
(401), an unknown route or model (404); and the command line's (exit 2, one line)."""
from __future__ import annotations

import socket

import httpx
import pytest

from serve_helpers import client, live_server, metric, served_checkpoint

pytest.importorskip("tokenizers")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

KEY = "test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt, _ = served_checkpoint(str(tmp_path_factory.mktemp("serve-err")))
    off = str(tmp_path_factory.mktemp("serve-err-offload"))
    argv = ["--path", ckpt, "--gpu-batch-size", "2", "--prompt-len", "16", "--gen-len", "24", "--offload-dir", off,
            "--no-warmup", "--api-key", KEY]
    with live_server(argv) as (url, _):
        yield url


def post(url: str, path: str, body, key: str = KEY) -> httpx.Response:
    kw = {"json": body} if not isinstance(body, str) else {"content": body}
    return httpx.post(url + path, headers={"Authorization": f"Bearer {key}"}, timeout=30, **kw)


def error_of(resp: httpx.Response) -> dict:
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


OK = {"model": "ckpt", "prompt": "w1 w2"}
BAD = [  # (path, body, a word the one message names)
    ("/v1/completions", {**OK, "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {**OK, "logprobs": 2}, "logprobs"),
    ("/v1/completions", {**OK, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**OK, "max_tokens": 25}, "--gen-len"),  # beyond the plan: refused, not run
    ("/v1/completions", {**OK, "prompt": list(range(1, 18))}, "--prompt-len"),
    ("/v1/completions", {**OK, "temperature": -1}, "temperature"),
    ("/v1/completions", {**OK, "top_p": 0.5}, "top_p"),
    ("/v1/completions", {**OK, "stop": 5}, "stop"),
    ("/v1/completions", {**OK, "n": 0}, "n 0"),
    ("/v1/completions", {**OK, "seed": -1}, "seed"),
    ("/v1/completions", {**OK, "prompt": []}, "prompt"),
    ("/v1/completions", {**OK, "prompt": [99999]}, "prompt"),
    ("/v1/completions", {"prompt": "w1"}, "model"),
    ("/v1/completions", {**OK, "messages": []}, "messages"),
    ("/v1/completions", {**OK, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", "{not json", "JSON"),
    ("/v1/completions", [1, 2], "JSON object"),
    ("/v1/chat/completions", {"model": "ckpt"}, "messages"),
    ("/v1/chat/completions", {"model": "ckpt", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2,
                              "max_completion_tokens": 2}, "not both"),
    ("/v1/chat/completions", {"model": "ckpt", "messages": [{"role": "robot", "content": "w1"}]}, "role"),
]


@pytest.mark.parametrize("path,body,word", BAD)
def test_a_bad_request_is_400_with_one_message(server, path, body, word):
    resp = post(server, path, body)
    assert resp.status_code == 400, resp.text
    err = error_of(resp)
    assert word in err["message"] and "\n" not in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_the_api_key_is_required_on_v1_only(server):
    with pytest.raises(openai.AuthenticationError) as e:
        client(server).models.list()
    assert e.value.status_code == 401
    assert error_of(post(server, "/v1/completions", OK, key="wrong"))["code"] == "invalid_api_key"
    assert client(server, KEY).completions.create(model="ckpt", prompt="w1", max_tokens=2).choices[0].text
    assert httpx.get(server + "/health", timeout=10).status_code == 200
    assert metric(server, 'flexh2o_requests_refused_total{status="401"}') >= 2


def test_unknown_route_and_model_are_404(server):
    resp = post(server, "/v1/nothing", OK)
    assert resp.status_code == 404 and error_of(resp)["code"] == "unknown_url"
    assert httpx.get(server + "/nothing", timeout=10).status_code == 404
    with pytest.raises(openai.NotFoundError) as e:
        client(server, KEY).completions.create(model="gpt-4", prompt="w1", max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"
    assert httpx.get(server + "/v1/models/gpt-4", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=10).status_code == 404


@pytest.mark.parametrize("flags,says", [(["--prompt-file", "x.jsonl"], "--prompt-file"),
                                        (["--port", "70000"], "--port"), (["--max-queue", "0"], "--max-queue"),
                                        (["--colour"], "unrecognized")])
def test_bad_flags_are_one_line_and_exit_2(capsys, flags, says):
    from flexh2o.cli import serve as cli
    assert cli.main(flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flexh2o-serve: error:") and says in err and "\n" not in err, err


def test_a_busy_port_is_one_line_and_exit_2(capsys, tmp_path, offload_dir):
    from flexh2o.cli import serve as cli
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert cli.main(["--model", "opt-125m", "--port", str(port), "--offload-dir", offload_dir,
                         "--gen-len", "4", "--prompt-len", "8", "--num-gpu-batches", "1", "--gpu-batch-size", "1",
                         "--no-warmup"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("flexh2o-serve: error: --host 127.0.0.1 --port") and "cannot listen" in err, err
