"""benchmarks/fair.py's regime check (the model's weights must exceed the cap at every system's dtype) and
benchmarks/llamacpp.py's reading of llama-batched-bench's table. Nothing here is timed or builds llama.cpp."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

BENCH = os.path.join(os.path.abspath(os.path.join(__file__, "../../..")), "benchmarks")
sys.path.insert(0, BENCH)
import fair  # noqa: E402
import llamacpp  # noqa: E402

GIB = 2 ** 30


def hf_param_count(name: str) -> int:
    """Parameters of transformers' OPTForCausalLM at the sizes of flexh2o's config (tied head counted once)."""
    from transformers import OPTConfig, OPTForCausalLM
    from flexh2o.config import from_name
    c = from_name(name)
    hc = OPTConfig(vocab_size=c.vocab, hidden_size=c.hidden, num_hidden_layers=c.num_layers, ffn_dim=c.ffn,
                   num_attention_heads=c.num_heads, max_position_embeddings=c.max_positions,
                   word_embed_proj_dim=c.embed_dim, do_layer_norm_before=c.norm_before, enable_bias=True)
    with torch.device("meta"):
        model = OPTForCausalLM(hc)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["opt-125m", "opt-350m"])
def test_weight_bytes_match_transformers_parameters(name):
    n = hf_param_count(name)
    assert fair.weight_bytes(name, "float32") == 4 * n
    assert fair.weight_bytes(name, "bfloat16") == 2 * n
    assert fair.weight_bytes(name, "int4") == int(n * 9 / 16)  # 4 bits + an fp16 scale and min per 64 weights


def test_regime_refuses_weights_that_fit_and_names_a_model_that_does_not():
    with pytest.raises(ValueError, match=r"opt-350m's weights at bfloat16 .*fit inside.*smallest that does not "
                                         r"fit: opt-1.3b"):
        fair.check_regime("opt-350m", {"full": "bfloat16", "accelerate": "float32"}, int(1.25 * GIB))
    rows = fair.check_regime("opt-1.3b", {"full": "bfloat16", "h2o-q4": "int4", "accelerate": "float32"},
                             int(1.25 * GIB))
    got = {s: x for s, _, _, x in rows}
    assert got["h2o-q4"] < 1 < got["full"] < got["accelerate"]  # compressed weights may fit: reported, not refused
    assert got["accelerate"] == pytest.approx(2 * got["full"])


def test_compare_fair_refuses_in_one_line_before_running_anything(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(BENCH, "compare.py"), "--model", "opt-350m", "--mem-cap",
                        "1.25GB", "--fair", "--systems", "full,accelerate", "--peer-dtype", "float32",
                        "--log-file", str(tmp_path / "x.jsonl")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "fit inside the --mem-cap" in lines[0] and "opt-1.3b" in lines[0]
    assert not (tmp_path / "x.jsonl").exists()


TABLE = """
main: n_kv_max = 16448, n_batch = 2048, n_ubatch = 512, flash_attn = auto, is_pp_shared = 0, n_gpu_layers = -1

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |     32 |    1 |    160 |    0.500 |   256.00 |    0.400 |    77.50 |    0.900 |   177.78 |
|   128 |     32 |    8 |   1280 |    4.000 |   256.00 |    2.000 |   128.00 |    6.000 |   213.33 |
"""


def test_llamacpp_rows_become_records_with_flexh2os_throughputs():
    rows = llamacpp.parse_rows(TABLE)
    assert [r["num_seqs"] for r in rows] == [1, 8]
    rec = llamacpp.record(rows[1], "/x/m.gguf", 2)
    assert rec["prefill_throughput"] == pytest.approx(8 * 128 / 4.0)
    assert rec["decode_throughput"] == pytest.approx(128.0)
    assert rec["total_throughput"] == pytest.approx(8 * 32 / 6.0)  # generated tokens / (prefill + decode)


def test_llamacpp_command_gives_every_sequence_its_own_context():
    cmd = llamacpp.command("bin", "m.gguf", [8, 64], 128, 32, 2)
    assert int(cmd[cmd.index("-c") + 1]) >= 64 * (128 + 32)
    assert cmd[cmd.index("-npl") + 1] == "8,64" and cmd[cmd.index("-t") + 1] == "2"
