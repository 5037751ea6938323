"""The OpenAI batch format as a request job (batch/openai_format.py, batch/openai_job.py): every custom_id answered
once, each response body valid for the official openai package's types, greedy answers equal to the same requests
as .jsonl `prompt` lines (chats rendered by transformers' apply_chat_template), bad lines refused in one line with
exit 2, a line this model cannot answer failing alone, and resume after kill -9."""
from __future__ import annotations

import json
import os
import random
import sys

import pytest

pytest.importorskip("tokenizers")
openai = pytest.importorskip("openai")

from flexh2o.cli import run as cli  # noqa: E402
from request_helpers import chat_model, kill_9_until_done, read_jsonl, write_jsonl  # noqa: E402

TEMPLATE = ("{% for m in messages %}w{{ 10 + loop.index0 }} {{ m['content'] }} w3 {% endfor %}"
            "{% if add_generation_prompt %}w4{% endif %}")
EOS = "21"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(checkpoint, tokenizer folder holding a chat_template.jinja, a tokenizer folder without one)."""
    return chat_model(str(tmp_path_factory.mktemp("oaimodel")), TEMPLATE)


def _argv(ckpt, tok, prompts, out, off, *extra):
    return ["--path", ckpt, "--tokenizer", tok, "--prompt-file", str(prompts), "--output-file", str(out),
            "--offload-dir", off, "--no-warmup", "--verbose", "0", "--eos-id", EOS, *extra]


def _line(cid, url, body):
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


CHAT = [{"role": "system", "content": "w40 w41"}, {"role": "user", "content": "w50 w51 w52"}]
LINES = [
    _line("c-text", "/v1/completions", {"model": "tiny", "prompt": "w5 w6 w7 w8", "max_tokens": 12}),
    _line("c-ids", "/v1/completions", {"prompt": [9, 10, 11], "max_tokens": 9, "stop": "w77"}),
    _line("chat-1", "/v1/chat/completions", {"model": "m", "messages": CHAT, "max_completion_tokens": 10}),
    _line("chat-2", "/v1/chat/completions", {"messages": CHAT[1:], "max_tokens": 14, "temperature": 0}),
    _line("c-n", "/v1/completions", {"prompt": "w100 w101", "max_tokens": 6, "n": 3, "temperature": 0.9,
                                     "top_k": 20, "top_p": 0.95, "seed": 4}),
]


def _rendered(tok: str, messages: list) -> str:
    """The chat's prompt text as transformers renders it (apply_chat_template), the reference for the template."""
    import transformers
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(tok, "tokenizer.json"),
                                               chat_template=TEMPLATE)
    return ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_round_trip_answers_every_line_with_valid_objects(tmp_path, model, offload_dir):
    ckpt, tok, _ = model
    out = tmp_path / "out.jsonl"
    assert cli.main(_argv(ckpt, tok, write_jsonl(tmp_path / "b.jsonl", LINES), out, offload_dir,
                          "--gpu-batch-size", "3")) == 0
    got = read_jsonl(out)
    assert sorted(r["custom_id"] for r in got) == sorted(ln["custom_id"] for ln in LINES)  # each exactly once
    by_id = {r["custom_id"]: r for r in got}
    for line in LINES:
        r = by_id[line["custom_id"]]
        assert r["error"] is None and r["response"]["status_code"] == 200 and r["id"].startswith("batch_req_")
        body = r["response"]["body"]
        kind = openai.types.chat.ChatCompletion if "chat" in line["url"] else openai.types.Completion
        obj = kind.model_validate(body)
        assert obj.model == line["body"].get("model", "tiny-req")  # echoed, else the run's model
        assert len(obj.choices) == line["body"].get("n", 1)
        assert obj.usage.total_tokens == obj.usage.prompt_tokens + obj.usage.completion_tokens
    sampled = by_id["c-n"]["response"]["body"]
    assert len({c["text"] for c in sampled["choices"]}) > 1  # n sampled choices, each with its own seed
    assert 3 <= sampled["usage"]["completion_tokens"] <= 3 * 6 and sampled["usage"]["prompt_tokens"] == 2

    # the greedy lines again as a .jsonl job of `prompt` lines: the same answers and token counts
    plain = [{"id": "c-text", "prompt": "w5 w6 w7 w8", "max_new_tokens": 12},
             {"id": "c-ids", "prompt_ids": [9, 10, 11], "max_new_tokens": 9, "stop": ["w77"]},
             {"id": "chat-1", "prompt": _rendered(tok, CHAT), "max_new_tokens": 10},
             {"id": "chat-2", "prompt": _rendered(tok, CHAT[1:]), "max_new_tokens": 14}]
    ref_out = tmp_path / "ref.jsonl"
    assert cli.main(_argv(ckpt, tok, write_jsonl(tmp_path / "p.jsonl", plain), ref_out, offload_dir)) == 0
    for want in read_jsonl(ref_out):
        body = by_id[want["id"]]["response"]["body"]
        choice = body["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert text == want["text"], want["id"]
        assert body["usage"] == {"prompt_tokens": want["prompt_tokens"], "completion_tokens": want["generated_tokens"],
                                 "total_tokens": want["prompt_tokens"] + want["generated_tokens"]}
        assert choice["finish_reason"] == {"eos": "stop", "stop": "stop", "length": "length"}[want["finish_reason"]]


BAD = [  # (line, what the one-line error names)
    (_line("x", "/v1/completions", {"prompt": "w1", "logit_bias": {}}), "line 2: body.logit_bias: not taken"),
    (_line("x", "/v1/completions", {"messages": CHAT}), "line 2: body.messages: not taken"),
    (_line("x", "/v1/embeddings", {"input": "w1"}), "line 2: url '/v1/embeddings'"),
    ({**_line("x", "/v1/completions", {"prompt": "w1"}), "method": "GET"}, "line 2: method 'GET'"),
    ({**_line("x", "/v1/completions", {"prompt": "w1"}), "extra": 1}, "line 2: extra: unknown field"),
    (_line("x", "/v1/completions", {"prompt": "w1", "temperature": -1}), "line 2: body.temperature -1"),
    (_line("x", "/v1/completions", {"prompt": "w1", "max_tokens": 0}), "line 2: body.max_tokens 0"),
    (_line("x", "/v1/completions", {"prompt": "w1", "n": 0}), "line 2: body.n 0"),
    (_line("x", "/v1/completions", {"prompt": "w1", "top_k": 5}), "line 2: body.top_k 5: this request decodes"),
    (_line("x", "/v1/chat/completions", {"messages": [{"role": "bot", "content": "w1"}]}),
     "line 2: body.messages[0]: role 'bot'"),
    (_line("a", "/v1/completions", {"prompt": "w1"}), "line 2: custom_id 'a' repeats line 1"),
]


@pytest.mark.parametrize("bad, error", BAD)
def test_a_bad_line_is_refused_in_one_line(capsys, tmp_path, model, offload_dir, bad, error):
    ckpt, tok, _ = model
    p = write_jsonl(tmp_path / "b.jsonl", [_line("a", "/v1/completions", {"prompt": "w1"}), bad])
    out = tmp_path / "o.jsonl"
    assert cli.main(_argv(ckpt, tok, p, out, offload_dir)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and error in err, err
    assert not out.exists()


def test_a_line_the_model_cannot_answer_fails_alone(capsys, tmp_path, model, offload_dir):
    """Past the model's positions, and a chat for a model without a chat template: error lines; the rest runs."""
    ckpt, _, plain = model
    lines = [_line("ok", "/v1/completions", {"prompt": "w1 w2", "max_tokens": 4}),
             _line("long", "/v1/completions", {"prompt": "w1 " * 150, "max_tokens": 20}),
             _line("chat", "/v1/chat/completions", {"messages": CHAT})]
    out = tmp_path / "o.jsonl"
    assert cli.main(_argv(ckpt, plain, write_jsonl(tmp_path / "b.jsonl", lines), out, offload_dir)) == 0
    got = {r["custom_id"]: r for r in read_jsonl(out)}
    assert sorted(got) == ["chat", "long", "ok"]
    assert got["ok"]["error"] is None
    for cid, says in (("long", "exceeds the model's 160 positions"), ("chat", "no chat template")):
        assert got[cid]["response"] is None and says in got[cid]["error"]["message"], got[cid]
        openai.types.BatchError.model_validate(got[cid]["error"])
    assert "2 line(s) failed" in capsys.readouterr().err


@pytest.mark.slow
def test_kill_9_then_resume_answers_every_line_once(tmp_path, model, offload_dir):
    ckpt, tok, _ = model
    rng = random.Random(4)
    lines = [_line(f"q{i}", "/v1/completions",
                   {"prompt": " ".join(f"w{rng.randrange(4, 512)}" for _ in range(rng.randint(2, 12))),
                    "max_tokens": rng.randint(8, 24)}) for i in range(24)]
    batch = write_jsonl(tmp_path / "b.jsonl", lines)
    whole = tmp_path / "whole.jsonl"
    assert cli.main(_argv(ckpt, tok, batch, whole, offload_dir, "--gpu-batch-size", "2")) == 0
    want = {r["custom_id"]: _choices(r) for r in read_jsonl(whole)}
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "flexh2o.cli"] + _argv(ckpt, tok, batch, out, offload_dir, "--gpu-batch-size", "2",
                                                         "--resume")
    kills = kill_9_until_done(argv, out, rng)
    got = read_jsonl(out)
    assert kills >= 2 and len(got) == 24 and len({r["custom_id"] for r in got}) == 24  # every line once
    assert {r["custom_id"]: _choices(r) for r in got} == want


def _choices(record: dict) -> list:
    """A line's answers without the ids and times that differ between runs."""
    return [json.dumps(c, sort_keys=True) for c in record["response"]["body"]["choices"]]
