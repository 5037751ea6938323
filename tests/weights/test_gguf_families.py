"""GGUF files of every architecture llama.cpp writes for a flexh2o family (llama with linear RoPE, llama with a
window = Mistral, qwen2, qwen3, phi3, gemma2, gemma3), written from the seeded transformers checkpoints as
llama.cpp's converter writes them (tests/family_gguf.py): converted, they greedy-decode with transformers' own tokens
and logits on the Hugging Face model (fp32 tensors); quantized ones (Q8_0 / Q4_0) kept in their blocks give the
logits of the same file expanded. Metadata that would change the computation and is not implemented is refused in
one line (flexh2o-convert: exit status 2)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import family_gguf as fg  # noqa: E402
from test_families import ATOL, GEN, LENS, PLACES, RTOL, _generate  # noqa: E402
from test_llama import hf_step_logits  # noqa: E402
from flexh2o.engine import Engine  # noqa: E402
from flexh2o.placement import Percent  # noqa: E402
from flexh2o.run_config import RunConfig, opened_with_kept  # noqa: E402
from flexh2o.sampling import TeacherForcer  # noqa: E402
from flexh2o.weights.convert import convert  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in LENS]


@pytest.mark.parametrize("case", list(fg.CASES))
def test_gguf_greedy_equals_transformers(case, prompts, tmp_path):
    model = fg.case_model(case)
    src = fg.write_gguf(model, case, str(tmp_path / f"{case}.gguf"))
    cfg = convert(src, str(tmp_path / "ckpt"), dtype="float32").config
    gen = _generate(cfg, str(tmp_path / "ckpt"), prompts, PLACES["memory"], tmp_path)
    want = hf_step_logits(model, prompts, gen.tokens)
    steps = torch.stack(gen.step_logits, 1)
    assert steps.abs().max() > 1.0  # not a degenerate model
    torch.testing.assert_close(steps, want, atol=ATOL, rtol=RTOL)
    assert torch.equal(gen.tokens, want.argmax(-1)), "greedy tokens differ from transformers"


def test_gguf_config_facts(tmp_path):
    """What each architecture's metadata (or llama.cpp's fixed rule) says reached the ModelConfig."""
    got = {}
    for case in ("mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"):
        src = fg.write_gguf(fg.case_model(case), case, str(tmp_path / f"{case}.gguf"))
        got[case] = convert(src, str(tmp_path / case), dtype="float32").config
    assert got["mistral"].family == "mistral" and got["mistral"].window(0) == fg.fm.WINDOW
    assert got["qwen2"].attn_bias and got["qwen3"].qk_norm and got["qwen3"].head_dim == 32
    assert got["phi3"].family == "phi3"
    g2, g3 = got["gemma2"], got["gemma3"]
    assert [g2.window(i) for i in range(3)] == [fg.fm.WINDOW, None, fg.fm.WINDOW]
    assert (g2.attn_softcap, g2.final_softcap, g2.query_scalar) == (4.0, 8.0, 32.0)
    assert [g3.window(i) is None for i in range(6)] == [False] * 5 + [True]
    assert (g3.local_rope_theta, g3.rope_type, g3.rope_factor, g3.rope_theta) == (10000.0, "linear", 2.0, 50000.0)


def _mixed(key: str, shape: tuple):
    """Q4_0 for the MLP, Q8_0 for the rest (fused phi3 projections included)."""
    return "Q4_0" if ".mlp." in key else "Q8_0"


@pytest.mark.parametrize("case", ["qwen2", "phi3", "gemma3"])
def test_gguf_kept_blocks_equal_expanded(case, prompts, tmp_path):
    """Q8_0/Q4_0 tensors kept in their blocks (generic path) give the logits of the same file expanded to fp32,
    teacher-forced on the same tokens."""
    src = fg.write_gguf(fg.case_model(case), case, str(tmp_path / "q.gguf"), quant=_mixed)
    convert(src, str(tmp_path / "kept"), "float32", keep_blocks=True)
    cfg = convert(src, str(tmp_path / "fp32"), "float32").config
    targets = torch.randint(3, 1000, (len(prompts), GEN), generator=torch.Generator().manual_seed(5))
    runs = {}
    for form in ("kept", "fp32"):
        checkpoint, kept = opened_with_kept(str(tmp_path / form), None, None)  # as flexh2o-run opens it
        rc = RunConfig(model=cfg, percent=Percent.parse(PLACES["memory"]), gpu_batch_size=2, prompt_len=max(LENS),
                       gen_len=GEN, dtype=torch.float32, path=checkpoint.path, offload_dir=str(tmp_path),
                       compress_weight=kept, checkpoint=checkpoint, weight_kernel="generic")
        with Engine(rc) as eng:
            gen = eng.generate(prompts, GEN, sampler=TeacherForcer(targets), record_logits=True)
            runs[form] = torch.stack(gen.step_logits, 1)
    assert rc.compress_weight is None and opened_with_kept(str(tmp_path / "kept"), None, None)[1] is not None
    torch.testing.assert_close(runs["kept"], runs["fp32"], atol=1e-4, rtol=1e-4)


REFUSED = [
    ("qwen2", "qwen2.expert_count", 4, "qwen2.expert_count = 4 changes the computation"),
    ("qwen2", "qwen2.attention.sliding_window", 16, "qwen2.attention.sliding_window = 16"),
    ("gemma3", "gemma3.attn_logit_softcapping", 50.0, "gemma3.attn_logit_softcapping = 50.0"),
    ("phi3", "phi3.rope.dimension_count", 8, "phi3.rope.dimension_count = 8 is not supported"),
    ("phi3", "rope_factors_long.weight", None, "Phi-3 longrope"),
    ("mistral", "llama.rope.scaling.type", "yarn", "rope scaling yarn"),
]


def _refused_gguf(tmp_path, case: str, key: str, value) -> str:
    import numpy as np
    src = str(tmp_path / "x.gguf")
    fg.write_gguf(fg.case_model(case), case, src, extra=lambda w: (w.add_tensor(key, np.ones(8, dtype=np.float32))
                                                                if value is None else _add_key(w, key, value)))
    return src


@pytest.mark.parametrize("case, key, value, says", REFUSED)
def test_gguf_unimplemented_metadata_refused(case, key, value, says, tmp_path):
    """A computation-changing key (or tensor) flexh2o does not implement: one line naming it, nothing written."""
    dst = tmp_path / "out"
    with pytest.raises(ValueError) as e:
        convert(_refused_gguf(tmp_path, case, key, value), str(dst))
    assert says in str(e.value) and "\n" not in str(e.value)
    assert not dst.exists() or not any(dst.iterdir())


def test_gguf_refusal_exits_2(tmp_path):
    """flexh2o-convert turns such a refusal into one line on stderr and exit status 2."""
    case, key, value, says = REFUSED[0]
    r = subprocess.run([sys.executable, "-m", "flexh2o.cli.convert", _refused_gguf(tmp_path, case, key, value),
                        str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def _add_key(w, key: str, value) -> None:
    if isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    else:
        w.add_uint32(key, value)
