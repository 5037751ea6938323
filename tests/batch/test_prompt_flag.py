"""flexh2o-run --prompt TEXT (repeatable, --chat), `messages` lines of a .jsonl job, LLM.chat, and top_k: answers
equal the same requests as .jsonl `prompt` lines, chats rendered by transformers' apply_chat_template; top-k
sampling equals transformers' TopKLogitsWarper followed by the same seeded draw."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from flexh2o.cli import run as cli  # noqa: E402
from flexh2o.sampling import Sampler  # noqa: E402
from request_helpers import chat_model, read_jsonl, write_jsonl  # noqa: E402

TEMPLATE = "{% for m in messages %}w7 {{ m['content'] }} w8 {% endfor %}{% if add_generation_prompt %}w9{% endif %}"
PROMPTS = ["w5 w6 w7 w8", "w100 w200 w300"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(checkpoint, tokenizer folder with a chat_template.jinja, tokenizer folder without one)."""
    return chat_model(str(tmp_path_factory.mktemp("promptmodel")), TEMPLATE)


def _base(ckpt, tok, off, *extra):
    return ["--path", ckpt, "--tokenizer", tok, "--offload-dir", off, "--no-warmup", "--gen-len", "10", *extra]


def _rendered(tok: str, text: str) -> str:
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(tok, "tokenizer.json"),
                                               chat_template=TEMPLATE)
    return ref.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)


def _jsonl_texts(tmp_path, ckpt, tok, off, rows) -> list:
    n = len(list(tmp_path.glob("ref*.jsonl")))
    out, src = tmp_path / f"ref{n}.jsonl", write_jsonl(tmp_path / f"r{n}.jsonl", rows)
    assert cli.main(_base(ckpt, tok, off, "--verbose", "0", "--prompt-file", src, "--output-file", str(out))) == 0
    return [r["text"] for r in sorted(read_jsonl(out), key=lambda r: r["id"])]


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_prompt_prints_each_answer_in_order(capsys, tmp_path, model, offload_dir, chat):
    ckpt, tok, _ = model
    argv = _base(ckpt, tok, offload_dir, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], *(["--chat"] * chat))
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    rows = [{"id": str(i), "prompt": _rendered(tok, p) if chat else p} for i, p in enumerate(PROMPTS)]
    assert out.splitlines() == _jsonl_texts(tmp_path, ckpt, tok, offload_dir, rows)  # the texts only, in order
    assert "generated tokens" in err and "generated tokens" not in out  # the summary stays on stderr


def test_messages_lines_equal_rendered_prompt_lines(tmp_path, model, offload_dir):
    ckpt, tok, _ = model
    msgs = [{"role": "system", "content": "w11 w12"}, {"role": "user", "content": [{"type": "text", "text": "w13"}]}]
    got = _jsonl_texts(tmp_path, ckpt, tok, offload_dir, [{"id": "a", "messages": msgs}])
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(tok, "tokenizer.json"),
                                               chat_template=TEMPLATE)
    plain = [{**m, "content": "w13"} if m["role"] == "user" else m for m in msgs]  # text parts joined: one part
    text = ref.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    assert got == _jsonl_texts(tmp_path, ckpt, tok, offload_dir, [{"id": "a", "prompt": text}])


@pytest.mark.parametrize("extra, error", [
    (["--prompt", "w1", "--prompt-file", "x.jsonl"], "--prompt and --prompt-file both give the prompts"),
    (["--chat"], "--chat renders --prompt's texts"),
    (["--prompt", "w1", "--output-file", "o.json"], "--output-file o.json: --prompt's answers are written as .jsonl"),
    (["--prompt", "w1", "--top-k", "5"], "--top-k 5 is unused: every row decodes greedily"),
    (["--prompt", "w1", "--top-k", "-1"], "--top-k -1: must be at least 0"),
])
def test_prompt_flag_refusals(capsys, tmp_path, model, offload_dir, extra, error, monkeypatch):
    ckpt, tok, _ = model
    monkeypatch.chdir(tmp_path)
    assert cli.main(_base(ckpt, tok, offload_dir, *extra)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and error in err, err


def test_a_model_without_a_template_refuses_messages(capsys, tmp_path, model, offload_dir):
    ckpt, _, plain = model
    assert cli.main(_base(ckpt, plain, offload_dir, "--prompt", "w1", "--chat")) == 2
    assert "--prompt 1: messages: this model has no chat template" in capsys.readouterr().err
    p = write_jsonl(tmp_path / "r.jsonl", [{"id": "a", "prompt": "w1"}, {"id": "b", "messages": [
        {"role": "user", "content": "w1"}]}])
    assert cli.main(_base(ckpt, plain, offload_dir, "--prompt-file", p, "--output-file", str(tmp_path / "o.jsonl"))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 2: messages: this model has no chat template" in err


def test_prompt_is_a_flag_of_its_own():
    args = cli.build_parser().parse_args(["--prompt", "a", "--prompt", "b", "--prompt-len", "7"])
    assert (args.prompt, args.prompt_len, args.prompt_file) == (["a", "b"], 7, None)


@pytest.mark.parametrize("top_k", [1, 5, 49, 50, 0])
def test_top_k_equals_transformers_warper_then_the_same_draw(top_k):
    """Exact: the same masked logits (-inf outside the top k; ties at the k-th kept by both), the same softmax and
    the same seeded multinomial give the same tokens."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(top_k))  # (b, vocab)
    ours = Sampler(0.7, 1.0, seed=3, top_k=top_k)
    scores = TemperatureLogitsWarper(0.7)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        want = torch.multinomial(scores.softmax(-1), 1, generator=g)[:, 0]
        assert torch.equal(ours(logits), want)
    if top_k:
        kept = logits.topk(top_k, -1).indices  # (b, k)
        assert all(int(t) in kept[i] for i, t in enumerate(Sampler(5.0, 1.0, 1, top_k)(logits)))
    assert torch.equal(Sampler(9.0, 1.0, 0, top_k=1)(logits), logits.argmax(-1))


def test_llm_chat_equals_generate_of_the_rendered_prompt(model, offload_dir):
    from flexh2o.api import LLM, SamplingParams
    ckpt, tok, _ = model
    with LLM(ckpt, tokenizer=tok, offload_dir=offload_dir, no_warmup=True, verbose=0) as llm:
        chats = [[{"role": "user", "content": p}] for p in PROMPTS]
        got = llm.chat(chats, SamplingParams(max_tokens=8))
        want = llm.generate([_rendered(tok, p) for p in PROMPTS], SamplingParams(max_tokens=8))
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert llm.chat(chats[0], SamplingParams(max_tokens=8))[0].token_ids == want[0].token_ids  # one alone
        sampled = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=1.0, top_k=1, seed=5))
        assert [r.token_ids for r in sampled] == [r.token_ids for r in llm.generate(PROMPTS, SamplingParams(
            max_tokens=8))]  # top_k 1 at any temperature is greedy
        with pytest.raises(ValueError, match="conversation 0: messages\\[0\\]: role 'x'"):
            llm.chat([[{"role": "x", "content": "w1"}]])


@pytest.mark.eval
def test_the_readme_chat_examples_print_what_the_readme_shows(capsys, tmp_path, monkeypatch, offload_dir):
    """The README's --prompt line prints its `# -> ` line; its chat batch file is answered as its comment shows."""
    import json
    import re
    import shlex
    openai = pytest.importorskip("openai")
    pytest.importorskip("gguf")
    from test_readme import _readme
    lines = _readme()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("flexh2o-run --model smollm2 --prompt "))
    monkeypatch.chdir(tmp_path)
    assert cli.main(shlex.split(lines[at])[1:] + ["--offload-dir", offload_dir]) == 0
    assert capsys.readouterr().out.splitlines() == [lines[at + 1][len("# -> "):]]
    printf = next(ln for ln in lines if ln.startswith("printf '{\"custom_id\""))
    target = shlex.split(printf)
    (tmp_path / target[-1]).write_text(target[1].replace("\\n", "\n"))
    run = next(ln for ln in lines if ln.startswith("flexh2o-run --model smollm2 --prompt-file chats.jsonl"))
    assert cli.main(shlex.split(run)[1:] + ["--offload-dir", offload_dir]) == 0
    shown = next(ln for ln in lines if ln.startswith("# chat_answers.jsonl: "))
    (got,) = read_jsonl(tmp_path / "chat_answers.jsonl")
    chat = openai.types.chat.ChatCompletion.model_validate(got["response"]["body"])
    assert got["custom_id"] == "q1" and got["error"] is None
    assert chat.choices[0].message.content == json.loads(re.search(r'"content": ("[^"]*")', shown).group(1))
