"""Defaults a new user meets: dtype auto keeps a checkpoint's own dtype and a GGUF's blocks; a budget from ratios has
a floor in tokens (a token budget is obeyed exactly, with one warning under it); the converter keeps the tokenizer,
EOS id and chat template so `--path CKPT` alone runs; model names say whether weights are real; messages are true
and quiet. Tiny seeded checkpoints (tests/tiny_models.py, tiny_gguf.py); the real SmolLM2 only under `eval`."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from flexh2o import config
from flexh2o.cli import convert as convert_cli
from flexh2o.cli import run as cli
from flexh2o.kv.spec import RATIO_FLOOR, KVSpec
from flexh2o.weights.format import CheckpointReader
from flexh2o.weights.run_files import TEMPLATE_FILE
from tiny_gguf import write_tiny_gguf
from tiny_models import tiny_opt, write_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _byte_chars() -> list:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _vocab() -> tuple:
    """(tokens, merges, token types) of a 262-token byte-level BPE: 256 bytes, 3 merges, 3 control tokens."""
    chars = _byte_chars()
    sp, t, h, e = chars[ord(" ")], chars[ord("t")], chars[ord("h")], chars[ord("e")]
    merges = [f"{t} {h}", f"{t}{h} {e}", f"{sp} {t}{h}{e}"]
    tokens = chars + [t + h, t + h + e, sp + t + h + e] + list(SPECIAL)
    return tokens, merges, [1] * 259 + [3] * 3


def _gguf_with_tokenizer(path: str) -> str:
    """tiny_gguf's llama file with a byte-level BPE tokenizer, bos/eos ids and a chat template in its metadata."""
    tokens, merges, types = _vocab()

    def extra(w):
        w.add_string("tokenizer.ggml.model", "gpt2")
        w.add_string("tokenizer.ggml.pre", "default")
        w.add_array("tokenizer.ggml.tokens", tokens)
        w.add_array("tokenizer.ggml.merges", merges)
        w.add_array("tokenizer.ggml.token_type", types)
        w.add_uint32("tokenizer.ggml.bos_token_id", 259)
        w.add_uint32("tokenizer.ggml.eos_token_id", 261)
        w.add_string("tokenizer.chat_template", TEMPLATE)
    return write_tiny_gguf(path, extra=extra)


@pytest.fixture(scope="module")
def gguf_ckpt(tmp_path_factory) -> tuple:
    """(the .gguf, its flexh2o-convert with no flags)."""
    d = tmp_path_factory.mktemp("gguf")
    src = _gguf_with_tokenizer(str(d / "tiny.gguf"))
    assert convert_cli.main([src, str(d / "ckpt")]) == 0
    return src, str(d / "ckpt")


# ---- 1. dtype auto: the checkpoint's own --------------------------------------------------------------------------
def test_convert_keeps_a_ggufs_blocks_and_its_float32_by_default(gguf_ckpt, tmp_path, capsys):
    _, ckpt = gguf_ckpt
    reader = CheckpointReader(ckpt)
    assert reader.kept(), "a GGUF's quantized tensors are kept in their blocks by default"
    assert reader.dtype("model.norm.weight") == torch.float32  # F32 in the GGUF, stored without loss
    src = gguf_ckpt[0]
    assert convert_cli.main([src, str(tmp_path / "x"), "--expand-blocks"]) == 0
    assert "as float32 (the source's own)" in capsys.readouterr().out
    assert not CheckpointReader(str(tmp_path / "x")).kept()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_run_on_a_checkpoint_stores_its_dtype_and_never_computes_narrower(tmp_path, dtype):
    ckpt = write_tiny_checkpoint(str(tmp_path / "ckpt"), dtype=dtype)
    args = cli.build_parser().parse_args(["--path", ckpt, "--prompt-len", "8", "--gen-len", "2"])
    rc = cli.build_run_config(args, config.load_converted_config(ckpt), None)
    assert rc.dtype == getattr(torch, dtype)
    allowed = {torch.float32} if dtype == "float32" else {torch.float32, torch.bfloat16}
    assert rc.compute in allowed and (rc.decode_compute in allowed)
    assert "the checkpoint's own dtype" in args.dtype_choice.reason


# ---- 2. the floor of a budget from ratios -------------------------------------------------------------------------
def test_ratio_budgets_have_a_floor_that_the_papers_settings_never_reach():
    short = KVSpec.from_flags("h2o", 6, 0.2)
    assert short.budget.total == RATIO_FLOOR and short.budget.heavy == RATIO_FLOOR // 2
    assert KVSpec.from_flags("h2o", 6, 0.2, exact_ratio=True).budget.total == 2  # int(0.2 * 6) twice
    for ratio in (0.1, 0.2):  # the paper: prompts of 512+ tokens at 20% (heavy + recent, or each)
        spec = KVSpec.from_flags("h2o", 512, ratio)
        assert spec.budget.heavy == spec.budget.recent == int(ratio * 512) and spec.budget.total >= RATIO_FLOOR
    assert KVSpec.from_flags("local", 6, 0.2).budget.total == RATIO_FLOOR
    assert KVSpec.from_flags("h2o", 6, kv_budget=8).budget.total == 8  # a token budget is obeyed exactly


def test_a_token_budget_under_the_floor_warns_once_and_the_summary_says_tokens(tmp_path, capsys, offload_dir):
    ckpt = write_tiny_checkpoint(str(tmp_path / "ckpt"))
    base = ["--path", ckpt, "--prompt-len", "6", "--gen-len", "3", "--offload-dir", offload_dir, "--no-warmup"]
    assert cli.main(base + ["--kv-budget", "8"]) == 0
    out, err = capsys.readouterr()
    assert err.count("warning") == 1 and f"--kv-budget 8 is under {RATIO_FLOOR} tokens" in err, err
    assert "(budget 8 tokens: heavy 4, recent 4)" in out
    assert cli.main(base + ["--hh-ratio", "0.2"]) == 0
    out, err = capsys.readouterr()
    assert f"(budget {RATIO_FLOOR} tokens:" in out and "warning" not in err
    assert f"keeps 2 tokens; kept {RATIO_FLOOR}" in err
    assert cli.main(base + ["--hh-ratio", "0.2", "--exact-ratio"]) == 0
    assert "(budget 2 tokens: heavy 1, recent 1)" in capsys.readouterr().out


# ---- 3. what a run needs, kept in the checkpoint ------------------------------------------------------------------
def test_convert_keeps_tokenizer_eos_and_chat_template_of_a_gguf(gguf_ckpt):
    from flexh2o.tokenizer import load_tokenizer
    src, ckpt = gguf_ckpt
    with open(os.path.join(ckpt, TEMPLATE_FILE)) as f:
        assert f.read() == TEMPLATE
    a, b = load_tokenizer(src), load_tokenizer(ckpt)
    text = "the theme <|im_start|>user\nthe 12 éh<|im_end|>"
    assert b.encode(text) == a.encode(text) and len(a.encode(text)) > 5
    assert (b.bos_id, b.eos_id, b.add_bos) == (a.bos_id, a.eos_id, a.add_bos) == (259, 261, False)


def test_path_alone_runs_a_text_prompt(gguf_ckpt, tmp_path, offload_dir):
    _, ckpt = gguf_ckpt
    (tmp_path / "p.txt").write_text("the theme\n")
    out = tmp_path / "out.json"
    assert cli.main(["--path", ckpt, "--prompt-file", str(tmp_path / "p.txt"), "--gen-len", "3", "--output-file",
                     str(out), "--offload-dir", offload_dir, "--no-warmup", "--verbose", "0"]) == 0
    row = json.loads(out.read_text())[0]
    assert len(row["tokens"]) == 3 and isinstance(row["text"], str)


def test_model_names_say_real_or_random_and_unknown_ones_list_what_is_taken(capsys):
    text = cli.build_parser().format_help()
    assert "smollm2 (SmolLM2-135M-Instruct, real weights" in " ".join(text.split())
    assert "seeded random weights: opt-125m" in " ".join(text.split())
    assert cli.main(["--model", "HuggingFaceTB/SmolLM2-135M", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown model" in err and "smollm2" in err and "nothing is downloaded" in err


# ---- 4. messages --------------------------------------------------------------------------------------------------
def test_a_plain_run_warns_nothing(tmp_path, capsys, offload_dir, monkeypatch):
    monkeypatch.setenv("FLEXH2O_CACHE_DIR", str(tmp_path / "empty-cache"))  # no profile of this machine
    ckpt = write_tiny_checkpoint(str(tmp_path / "ckpt"))
    assert cli.main(["--path", ckpt, "--prompt-len", "6", "--gen-len", "2", "--offload-dir", offload_dir,
                     "--no-warmup", "--verbose", "0"]) == 0
    err = capsys.readouterr().err
    assert "no prediction" not in err and "warning" not in err, err


def test_a_truncated_gguf_is_one_line(tmp_path, capsys):
    src = write_tiny_gguf(str(tmp_path / "t.gguf"))
    data = open(src, "rb").read()
    open(src, "wb").write(data[:len(data) * 2 // 3])
    assert convert_cli.main([src, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is truncated" in err and "reshape" not in err, err
    assert not os.path.exists(tmp_path / "out")


def test_too_large_a_batch_on_a_cpu_says_what_the_gpu_tier_is(capsys, offload_dir):
    assert cli.main(["--model", "opt-125m", "--gpu-batch-size", "100000", "--offload-dir", offload_dir]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no GPU here" in err and "This fits here: --percent" in err, err


def test_convert_help_names_the_families():
    from flexh2o.models import family_names
    text = " ".join(convert_cli.build_parser().format_help().split())
    assert family_names() and all(re.search(rf"\b{family}\b", text) for family in family_names()), text
    assert "OPT or Llama" not in text


def test_plan_defaults_match_run():
    from flexh2o.cli import plan
    args = plan.build_parser().parse_args(["--model", "opt-125m"])
    assert (args.hardware, args.dtype) == ("auto", cli.build_parser().parse_args([]).dtype) == ("auto", "auto")


@pytest.mark.parametrize("argv", [["--help"], ["--no-such-flag"]])
def test_convert_help_and_an_argparse_error_import_no_torch(argv):
    """flexh2o-convert's --help and a bad flag need only the parser: torch (over a second to import), the engine and
    the models stay unimported."""
    code = (f"import sys\nfrom flexh2o.cli import convert\ntry:\n    convert.main({argv!r})\nexcept SystemExit:\n"
            "    pass\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(("
            "'flexh2o.engine', 'flexh2o.weights.convert', 'flexh2o.models'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout + r.stderr


@pytest.mark.eval
def test_smollm2_converted_with_no_flags_runs_from_path_alone(tmp_path, offload_dir):
    from flexh2o.tokenizer import load_tokenizer
    from flexh2o.weights.source import bundled_gguf
    src = bundled_gguf("smollm2")
    assert convert_cli.main([src, str(tmp_path / "s")]) == 0
    assert CheckpointReader(str(tmp_path / "s")).kept()  # the Q4_1 blocks, as in the file
    a, b = load_tokenizer(src), load_tokenizer(str(tmp_path / "s"))
    assert b.encode("def fibonacci(n):\n    12345") == a.encode("def fibonacci(n):\n    12345") and b.eos_id == 2
    assert "<|im_start|>" in open(tmp_path / "s" / TEMPLATE_FILE).read()
    (tmp_path / "p.txt").write_text("def fibonacci(n):\n")
    out = tmp_path / "o.json"
    assert cli.main(["--path", str(tmp_path / "s"), "--prompt-file", str(tmp_path / "p.txt"), "--gen-len", "8",
                     "--hh-ratio", "0.2", "--output-file", str(out), "--offload-dir", offload_dir, "--no-warmup",
                     "--verbose", "0"]) == 0
    assert "return" in json.loads(out.read_text())[0]["text"] or "if n" in json.loads(out.read_text())[0]["text"]


def test_api_errors_speak_the_apis_names(tmp_path):
    from flexh2o.api import LLM, SamplingParams
    ckpt = write_tiny_checkpoint(str(tmp_path / "ckpt"))  # no tokenizer kept beside it
    with pytest.raises(ValueError) as e:
        LLM(ckpt, hh_ratio=1.5)
    assert "hh_ratio=1.5" in str(e.value) and "--" not in str(e.value)
    llm = LLM(ckpt, verbose=0)
    for prompts, params in ((["hello"], None), ([[5, 6]], SamplingParams(max_tokens=0))):
        with pytest.raises(ValueError) as e:
            llm.generate(prompts, params)
        assert "--" not in str(e.value) and "max_new_tokens" not in str(e.value), str(e.value)
    llm.close()


def test_eval_writes_json_only_when_asked(gguf_ckpt, tmp_path, monkeypatch, capsys):
    from flexh2o.cli import eval as eval_cli
    monkeypatch.chdir(tmp_path)
    argv = ["ppl", "--model", gguf_ckpt[1], "--context", "24", "--windows", "1", "--texts", "hamlet", "--prefix", "4",
            "--budgets", "8", "--policies", "h2o", "--no-progress", "--threads", "1"]
    assert eval_cli.main(argv) == 0
    assert os.listdir(tmp_path) == [] and "wrote" not in capsys.readouterr().out
    assert eval_cli.main(argv + ["--out", "r.json"]) == 0
    assert os.listdir(tmp_path) == ["r.json"] and "wrote r.json" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eval_auto_runs_the_checkpoints_own_dtype(gguf_ckpt, tmp_path, dtype):
    from flexh2o.eval.common import load_model
    ckpt = write_tiny_checkpoint(str(tmp_path / "ckpt"), dtype=dtype)
    assert load_model(ckpt, "auto", tokenizer=gguf_ckpt[0]).dtype == getattr(torch, dtype)
    assert load_model(gguf_ckpt[1], "auto").dtype == torch.float32  # the GGUF's F32 tensors, its blocks kept


def test_plan_takes_every_name_its_help_lists():
    """flexh2o-plan needs only shapes: `smollm2`, which its --help lists as real weights, plans as its shape."""
    from flexh2o.cli import plan
    args = plan.build_parser().parse_args(["--model", "smollm2", "--hardware", "cpu_measured", "--dtype", "float32",
                                           "--gpu-mem", "1GB", "--cpu-mem", "1GB", "--disk-mem", "1GB"])
    rc, _ = plan.plan_from_args(args)
    assert rc.model == config.from_name("smollm2-135m")


@pytest.mark.parametrize("form", ["string", "named list", "jinja file"])
def test_a_folders_tokenizer_ids_and_chat_template_are_kept(tmp_path, form):
    """A Hugging Face folder's tokenizer.json is copied, its bos/eos ids (generation_config.json over config.json)
    kept, and its chat template taken from chat_template.jinja or tokenizer_config.json (a string, or the one named
    'default' of a list)."""
    from flexh2o.weights.run_files import write_run_files
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "tokenizer.json").write_text('{"x": 1}')
    (src / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    template = {"string": TEMPLATE, "named list": [{"name": "tool_use", "template": "x"},
                                                   {"name": "default", "template": TEMPLATE}]}.get(form)
    if template is None:
        (src / "chat_template.jinja").write_text(TEMPLATE)
    else:
        (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    assert write_run_files(str(src), str(dst)) == ["tokenizer.json", "eos id [7, 8]", TEMPLATE_FILE]
    assert (dst / "tokenizer.json").read_text() == '{"x": 1}' and (dst / TEMPLATE_FILE).read_text() == TEMPLATE
    assert json.loads((dst / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": [7, 8]}
    assert (dst / "tokenizer_config.json").exists() == (form != "jinja file")  # copied where the folder has one


def test_a_gguf_whose_tokenizer_cannot_be_built_still_converts(gguf_ckpt, tmp_path, monkeypatch):
    """(e.g. a SentencePiece vocabulary without transformers installed): the weights, the EOS id and the chat
    template are kept, no tokenizer.json."""
    import flexh2o.tokenizer
    from flexh2o.weights.convert import convert

    def refuse(path):
        raise ValueError("no")
    monkeypatch.setattr(flexh2o.tokenizer, "from_gguf", refuse)
    result = convert(gguf_ckpt[0], str(tmp_path / "c"), keep_blocks=True)
    assert result.kept == ("eos id 261", TEMPLATE_FILE)
    assert sorted(os.listdir(tmp_path / "c")) == sorted(["chat_template.jinja", "flexh2o_config.json",
                                                         "generation_config.json", "index.json", "tensors"])
