"""Request jobs: JSONL parsing and its refusals, and stopping at EOS / stop strings / max_new_tokens against
transformers' greedy decoding with the same stopping on a tiny OPT."""
from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import hf_opt
from flexh2o.cli import run as cli
from flexh2o.requests import Defaults, Request, load_requests
from request_helpers import TINY, read_jsonl, write_checkpoint, write_jsonl, write_tokenizer

pytest.importorskip("tokenizers")


class WordTok:
    """Stand-in tokenizer for parsing tests: words 'w{i}'."""

    eos_id = None

    def encode(self, text):
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def test_parses_every_field(tmp_path):
    p = write_jsonl(tmp_path / "r.jsonl", [
        {"id": "a", "prompt": "w5 w6 w7"},
        {"id": "b", "prompt_ids": [1, 2], "max_new_tokens": 4, "stop": ["w9"], "temperature": 0.5, "top_p": 0.9,
         "seed": 7}, ""])
    a, b = load_requests(p, Defaults(max_new_tokens=16, temperature=0.0, top_p=1.0, seed=3), 100, WordTok())
    assert (a.id, a.prompt_ids, a.max_new_tokens, a.stop, a.seed, a.text) == ("a", (5, 6, 7), 16, (), 3, "w5 w6 w7")
    assert (b.prompt_ids, b.max_new_tokens, b.stop, b.temperature, b.top_p, b.seed) == ((1, 2), 4, ("w9",), 0.5,
                                                                                           0.9, 7)


BAD = [  # (line, field named in the error)
    ('{"id": "x", "prompt_ids": [1]', "not valid JSON"),
    ('[1, 2]', "not a JSON object"),
    ('{"prompt_ids": [1]}', "id: missing"),
    ('{"id": 5, "prompt_ids": [1]}', "id:"),
    ('{"id": "x"}', "prompt:"),
    ('{"id": "x", "prompt": "w1", "prompt_ids": [1]}', "prompt:"),
    ('{"id": "x", "prompt_ids": []}', "prompt_ids:"),
    ('{"id": "x", "prompt_ids": [1, 1000]}', "prompt_ids: token id 1000"),
    ('{"id": "x", "prompt_ids": [1], "max_new_tokens": 0}', "max_new_tokens"),
    ('{"id": "x", "prompt_ids": [1], "max_new_tokens": 2.5}', "max_new_tokens"),
    ('{"id": "x", "prompt_ids": [1], "stop": "w1"}', "stop:"),
    ('{"id": "x", "prompt_ids": [1], "stop": [""]}', "stop:"),
    ('{"id": "x", "prompt_ids": [1], "temperature": -1}', "temperature"),
    ('{"id": "x", "prompt_ids": [1], "top_p": 0}', "top_p"),
    ('{"id": "x", "prompt_ids": [1], "top_p": 0.9}', "top_p 0.9: this request decodes greedily"),
    ('{"id": "x", "prompt_ids": [1], "top_p": 0.9, "temperature": 0}', "top_p 0.9: this request decodes greedily"),
    ('{"id": "x", "prompt_ids": [1], "seed": -2}', "seed"),
    ('{"id": "x", "prompt_ids": [1], "colour": 1}', "colour: unknown field"),
    ('{"id": "a", "prompt_ids": [1]}', "'a' repeats line 1"),
]


@pytest.mark.parametrize("line,field", BAD)
def test_bad_line_refused_naming_line_and_field(tmp_path, line, field):
    p = write_jsonl(tmp_path / "r.jsonl", [{"id": "a", "prompt_ids": [3]}, line])
    with pytest.raises(ValueError) as e:
        load_requests(p, Defaults(), 100, WordTok())
    msg = str(e.value)
    assert "line 2:" in msg and field in msg and "\n" not in msg


def test_utf8_byte_order_mark_is_no_text(tmp_path, model):
    """A file saved with a UTF-8 byte-order mark (Windows Notepad): a .jsonl was refused ('Unexpected UTF-8 BOM
    (decode using utf-8-sig)') and a text prompt file silently began its first prompt with the mark (three more
    tokens with SmolLM2's tokenizer); the mark is now skipped."""
    from flexh2o.prompts import load_prompts
    from flexh2o.tokenizer import load_tokenizer
    _, tok, _ = model
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_bytes(b'\xef\xbb\xbf{"id": "a", "prompt_ids": [3, 4]}\r\n{"id": "b", "prompt": "w5 w6"}\r\n')
    a, b = load_requests(str(jsonl), Defaults(), 100, WordTok())
    assert (a.prompt_ids, b.prompt_ids) == ((3, 4), (5, 6))
    text = tmp_path / "p.txt"
    text.write_bytes(b"\xef\xbb\xbfw5 w6\r\nw7\r\n")
    assert load_prompts(str(text), TINY.vocab, load_tokenizer(tok)) == [[5, 6], [7]]


def test_request_checks_itself():
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request("a", (1,), max_new_tokens=0)
    with pytest.raises(ValueError, match="prompt_ids"):
        Request("a", ())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("reqmodel")
    weights = write_checkpoint(str(root / "ckpt"))
    tok = write_tokenizer(str(root / "tokenizer.json"), TINY.vocab)
    return str(root / "ckpt"), tok, hf_opt(TINY, weights)


def _argv(ckpt, prompts, out, off, *extra):
    return ["--path", ckpt, "--prompt-file", str(prompts), "--output-file", str(out), "--offload-dir", off,
            "--no-warmup", "--verbose", "0", *extra]


def test_cli_refuses_before_running(capsys, tmp_path, model, offload_dir):
    ckpt, tok, _ = model
    p = write_jsonl(tmp_path / "r.jsonl", [{"id": "a", "prompt_ids": [3]}, {"id": "b", "prompt": "w1 w2"}])
    out = tmp_path / "o.jsonl"
    assert cli.main(_argv(ckpt, p, out, offload_dir)) == 2  # text without --tokenizer
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 2: prompt:" in err and "--tokenizer" in err
    assert not out.exists() and not os.listdir(offload_dir) if os.path.exists(offload_dir) else not out.exists()
    out.write_text('{"id": "a"}\n')
    assert cli.main(_argv(ckpt, p, out, offload_dir, "--tokenizer", tok)) == 2  # results there, no --resume
    assert "--resume" in capsys.readouterr().err


def test_unused_top_p_refused_in_a_request_job(capsys, tmp_path, model, offload_dir):
    """--top-p below 1 is the default of the requests that sample: refused when every request decodes greedily,
    accepted (and run) when one request samples."""
    ckpt, _, _ = model
    out = tmp_path / "o.jsonl"
    greedy = write_jsonl(tmp_path / "g.jsonl", [{"id": "a", "prompt_ids": [3, 4], "max_new_tokens": 2}])
    assert cli.main(_argv(ckpt, greedy, out, offload_dir, "--top-p", "0.5")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--top-p 0.5 is unused" in err and not out.exists()
    mixed = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "prompt_ids": [3, 4], "max_new_tokens": 2},
                                               {"id": "b", "prompt_ids": [5], "max_new_tokens": 2, "temperature": 1}])
    assert cli.main(_argv(ckpt, mixed, out, offload_dir, "--top-p", "0.5")) == 0
    assert sorted(r["id"] for r in read_jsonl(out)) == ["a", "b"]


@pytest.mark.parametrize("flag", [["--cut-gen-len", "2"], ["--debug-mode", "fewer_batch"]])
def test_shortened_run_flags_refused_in_a_request_job(capsys, tmp_path, model, offload_dir, flag):
    """--cut-gen-len and --debug-mode fewer_batch (FlexGen's shortened benchmark runs) were silently ignored by a
    request job, which answered every request in full: now one line naming the flag, exit 2, no results file."""
    ckpt, _, _ = model
    p = write_jsonl(tmp_path / "r.jsonl", [{"id": "a", "prompt_ids": [3, 4], "max_new_tokens": 6}])
    out = tmp_path / "o.jsonl"
    assert cli.main(_argv(ckpt, p, out, offload_dir, *flag)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and " ".join(flag[:1] if flag[0] == "--cut-gen-len" else flag) in err
    assert "request job" in err and not out.exists()


def test_auto_batch_takes_no_more_rows_than_the_requests(capsys, tmp_path, model, offload_dir):
    """--gpu-batch-size auto picked the largest batch that fits (thousands of rows on this tiny model) for a job of
    5 requests, so every step ran thousands of idle rows (opt-125m: 190 s instead of 0.4 s); it now takes the
    requests' rows over --num-gpu-batches and says so."""
    ckpt, _, _ = model
    p = write_jsonl(tmp_path / "r.jsonl", [{"id": str(i), "prompt_ids": [3 + i, 4], "max_new_tokens": 3}
                                           for i in range(5)])
    out = tmp_path / "o.jsonl"
    argv = _argv(ckpt, p, out, offload_dir, "--gpu-batch-size", "auto", "--num-gpu-batches", "2")
    assert cli.main(argv + ["--dry-run"]) == 0
    said = [ln for ln in capsys.readouterr().err.splitlines() if "picked" in ln]
    assert len(said) == 1 and said[0].startswith("--gpu-batch-size auto: picked 3 (the prompts' rows; "), said
    assert int(said[0].split("; ")[1].split()[0]) > 3  # the largest batch that fits, named beside it
    assert cli.main(argv) == 0 and len(read_jsonl(out)) == 5


def test_requests_past_the_models_positions_named_by_line(capsys, tmp_path, model, offload_dir):
    """A request whose prompt + max_new_tokens exceed the model's positions was refused with 'shorten
    --prompt-len/--gen-len', flags that do not set a request job's lengths; now the line and the fix are named,
    and so are the two lines when the longest prompt and the largest max_new_tokens together exceed them."""
    ckpt, _, _ = model
    n = TINY.max_positions
    out = tmp_path / "o.jsonl"
    alone = write_jsonl(tmp_path / "alone.jsonl", [{"id": "a", "prompt_ids": [3], "max_new_tokens": 2},
                                                   {"id": "b", "prompt_ids": [4] * (n - 2), "max_new_tokens": 3}])
    assert cli.main(_argv(ckpt, alone, out, offload_dir)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 2: max_new_tokens 3" in err and f"model's {n} positions" in err
    assert "--prompt-len" not in err and "lower max_new_tokens" in err
    pair = write_jsonl(tmp_path / "pair.jsonl", [{"id": "a", "prompt_ids": [3] * (n - 4), "max_new_tokens": 2},
                                                 {"id": "b", "prompt_ids": [4], "max_new_tokens": 9}])
    assert cli.main(_argv(ckpt, pair, out, offload_dir)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"longest prompt ({n - 4} tokens, line 1)" in err
    assert "largest max_new_tokens (9, line 2)" in err and "--prompt-len" not in err and not out.exists()
    with pytest.raises(ValueError, match="line 2: max_new_tokens 3"):
        load_requests(alone, Defaults(), TINY.vocab, positions=n)
    assert len(load_requests(alone, Defaults(), TINY.vocab, positions=n + 1)) == 2


def _hf_generate(hf, prompt: list, max_new: int, eos=None) -> list:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_new, min_new_tokens=0, do_sample=False, eos_token_id=eos,
                          pad_token_id=TINY.pad_token_id)
    return out[0, len(prompt):].tolist()


def _stop_cut(tokens: list, stop: str) -> int:
    """Tokens kept when decoding stops at the first prefix whose text holds `stop` (all of them when none)."""
    for n in range(1, len(tokens) + 1):
        if stop in " ".join(f"w{i}" for i in tokens[:n]):
            return n
    return len(tokens)


def test_eos_stop_and_length_match_transformers(tmp_path, model, offload_dir):
    ckpt, tok, hf = model
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, TINY.vocab, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7, 4)]
    long = [_hf_generate(hf, p, 20) for p in prompts]
    eos = long[0][len(long[0]) // 2]  # a token some row really emits: rows that emit it stop there
    stops = {2: "w" + str(long[2][3]) + " ", 3: " w" + str(long[3][5])}  # complete words in the decoded text
    rows = []
    for i, p in enumerate(prompts):
        row = {"id": f"r{i}", "prompt_ids": p, "max_new_tokens": 20 if i % 2 == 0 else 11}
        if i in stops:
            row["stop"] = [stops[i]]
        rows.append(row)
    out = tmp_path / "o.jsonl"
    argv = _argv(ckpt, write_jsonl(tmp_path / "r.jsonl", rows), out, offload_dir, "--tokenizer", tok,
                 "--eos-id", str(eos), "--gpu-batch-size", "4")
    assert cli.main(argv) == 0
    got = {r["id"]: r for r in read_jsonl(out)}
    assert len(got) == len(rows)
    for i, (p, row) in enumerate(zip(prompts, rows)):
        want = _hf_generate(hf, p, row["max_new_tokens"], eos)  # transformers stops at EOS and at the max
        reason = "eos" if want[-1] == eos else "length"
        if i in stops:
            n = _stop_cut(want, stops[i])
            if n < len(want) or reason == "length" and stops[i] in " ".join(f"w{t}" for t in want):
                want, reason = want[:n], "stop"
        r = got[f"r{i}"]
        assert r["token_ids"] == want, f"request {i}"
        assert r["finish_reason"] == reason, f"request {i}"
        assert (r["prompt_tokens"], r["generated_tokens"]) == (len(p), len(want))
        text = " ".join(f"w{t}" for t in want)
        assert r["text"] == (text[:text.find(stops[i])] if reason == "stop" else text)
    reasons = {r["finish_reason"] for r in got.values()}
    assert reasons == {"eos", "stop", "length"}, reasons  # the test covers every way to finish


def test_ignore_eos_runs_to_the_max(tmp_path, model, offload_dir):
    ckpt, _, hf = model
    p = [7, 8, 9, 10]
    long = _hf_generate(hf, p, 10)
    out = tmp_path / "o.jsonl"
    rows = write_jsonl(tmp_path / "r.jsonl", [{"id": "x", "prompt_ids": p, "max_new_tokens": 10}])
    assert cli.main(_argv(ckpt, rows, out, offload_dir, "--eos-id", str(long[2]), "--ignore-eos")) == 0
    (r,) = read_jsonl(out)
    assert r["token_ids"] == long and r["finish_reason"] == "length" and r["text"] is None


def test_legacy_json_output_keeps_fixed_length(tmp_path, model, offload_dir):
    """The older formats (a .json output) keep FlexGen's fixed length: no EOS stopping there."""
    ckpt, _, _ = model
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([[5, 6, 7], [9, 10]]))
    out = tmp_path / "o.json"
    assert cli.main(["--path", ckpt, "--prompt-file", str(prompts), "--output-file", str(out), "--gen-len", "5",
                     "--offload-dir", offload_dir, "--no-warmup", "--verbose", "0"]) == 0
    assert [len(r["tokens"]) for r in json.loads(out.read_text())] == [5, 5]
