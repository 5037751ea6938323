"""flexh2o-serve with the official openai client against a live server on 127.0.0.1: completions and chat, streamed
and not (the streamed text is the unstreamed one), every answer the greedy tokens of transformers on its prompt
alone, 16 concurrent clients on 8 refilled rows, stop strings and n."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import hf_greedy, hf_opt
from request_helpers import TINY
from serve_helpers import TEMPLATE, client, live_server, metric, served_checkpoint

pytest.importorskip("tokenizers")
pytest.importorskip("openai")
pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    ckpt, weights = served_checkpoint(str(tmp_path_factory.mktemp("serve")))
    return ckpt, hf_opt(TINY, weights)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    """8 rows (2 GPU batches of 4), prompts up to 16 tokens, answers up to 24; EOS ignored, so every answer runs to
    its max_tokens and equals transformers' greedy tokens of that length."""
    off = str(tmp_path_factory.mktemp("serve-offload"))
    argv = ["--path", model[0], "--gpu-batch-size", "4", "--num-gpu-batches", "2", "--prompt-len", "16",
            "--gen-len", "24", "--offload-dir", off, "--ignore-eos", "--no-warmup"]
    with live_server(argv) as (url, _):
        yield url


def words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


def ids_of(text: str) -> list:
    return [int(w[1:]) for w in text.split()]


def streamed(c, **kw) -> tuple:
    """(text joined from the chunks, finish reasons per choice, usage) of a streamed completion."""
    texts, finish, usage = {}, {}, None
    for chunk in c.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            finish[ch.index] = ch.finish_reason or finish.get(ch.index)
    return texts, finish, usage


def test_completion_streamed_and_not_equal_transformers(server, model):
    c, hf = client(server), model[1]
    prompt = [5, 17, 300, 42, 9]
    want = hf_greedy(hf, prompt, 12)[0]
    whole = c.completions.create(model="ckpt", prompt=words(prompt), max_tokens=12)
    assert ids_of(whole.choices[0].text) == want
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (5, 12)
    texts, finish, usage = streamed(c, model="ckpt", prompt=words(prompt), max_tokens=12)
    assert texts == {0: whole.choices[0].text} and finish == {0: "length"}
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (5, 12, 17)
    by_ids = c.completions.create(model="ckpt", prompt=prompt, max_tokens=12)  # a prompt of token ids
    assert by_ids.choices[0].text == whole.choices[0].text


def test_chat_uses_the_template_as_transformers_renders_it(server, model):
    from transformers import PreTrainedTokenizerFast
    c = client(server)
    messages = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w30 w31 w32"}]
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=f"{model[0]}/tokenizer.json", chat_template=TEMPLATE)
    rendered = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = hf_greedy(model[1], ids_of(rendered), 10)[0]
    whole = c.chat.completions.create(model="ckpt", messages=messages, max_completion_tokens=10)
    msg = whole.choices[0].message
    assert (msg.role, ids_of(msg.content)) == ("assistant", want)
    assert whole.usage.prompt_tokens == len(ids_of(rendered))
    parts, roles = [], []
    for chunk in c.chat.completions.create(model="ckpt", messages=messages, max_tokens=10, stream=True):
        for ch in chunk.choices:
            roles += [ch.delta.role] if ch.delta.role else []
            parts.append(ch.delta.content or "")
    assert "".join(parts) == msg.content and roles == ["assistant"]


def test_sixteen_concurrent_clients_get_their_tokens_alone(server, model):
    """16 clients at once on 8 rows: rows are refilled as answers end, requests wait in the queue, and each
    answer equals transformers' greedy decoding of its prompt alone."""
    g = torch.Generator().manual_seed(11)
    jobs = [(torch.randint(4, TINY.vocab, (int(n),), generator=g).tolist(), int(m))
            for n, m in zip(torch.randint(1, 17, (16,), generator=g), torch.randint(1, 25, (16,), generator=g))]

    def ask(i):
        prompt, max_tokens = jobs[i]
        c = client(server)
        if i % 2:
            return streamed(c, model="ckpt", prompt=words(prompt), max_tokens=max_tokens)[0][0]
        return c.completions.create(model="ckpt", prompt=words(prompt), max_tokens=max_tokens).choices[0].text
    before = metric(server, "flexh2o_requests_finished_total")
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, range(16), timeout=120))
    for (prompt, max_tokens), text in zip(jobs, got):
        assert ids_of(text) == hf_greedy(model[1], prompt, max_tokens)[0], (prompt, max_tokens)
    assert metric(server, "flexh2o_requests_finished_total") - before == 16
    assert metric(server, "flexh2o_rows_busy") == 0 and metric(server, "flexh2o_queue_length") == 0


def test_stop_strings_n_and_seeds(server, model):
    c = client(server)
    prompt = [8, 9, 10, 11]
    full = hf_greedy(model[1], prompt, 16)[0]
    stop = f" w{full[6]} "  # a word of the answer: the text ends before its first appearance
    want = words(full)
    want = want[:want.find(stop)] if stop in want + " " else want
    whole = c.completions.create(model="ckpt", prompt=prompt, max_tokens=16, stop=[stop])
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "stop"
    texts, finish, _ = streamed(c, model="ckpt", prompt=prompt, max_tokens=16, stop=stop)
    assert texts == {0: want} and finish == {0: "stop"}
    two = c.completions.create(model="ckpt", prompt=prompt, max_tokens=8, n=2, temperature=1.0, seed=5)
    again = c.completions.create(model="ckpt", prompt=prompt, max_tokens=8, n=2, temperature=1.0, seed=5)
    assert [ch.index for ch in two.choices] == [0, 1]
    assert [ch.text for ch in two.choices] == [ch.text for ch in again.choices]  # seed, seed + 1: reproducible
    assert two.usage.completion_tokens == 16


def test_models_health_and_metrics(server):
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["ckpt"]
    assert c.models.retrieve("ckpt").id == "ckpt"
    assert metric(server, "flexh2o_rows") == 8
    assert metric(server, "flexh2o_generation_tokens_total") >= 0
