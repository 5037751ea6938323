"""--policy auto's dtype choice (planning/dtype_choice.choose_dtypes with `score`): the option whose searched plan is
predicted fastest wins over the probe's rank of the linears, options where nothing fits are passed over, and on the
AVX2 path (opt-1.3b streamed from disk) fp32 is chosen where it fits when the profile multiplies 16-bit dtypes far
slower."""
from __future__ import annotations

import torch

from flexh2o.config import from_name
from flexh2o.placement import Percent
from flexh2o.planning import dtype_choice
from flexh2o.run_config import RunConfig
from flexh2o.tuning.hardware import load_profile
from flexh2o.tuning.search import search

from test_dtype_choice import rc_for, timings

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def test_the_fastest_prediction_wins_over_the_probe_rank():
    """The probe ranks bf16 first; the score (seconds a token of each option's best plan) says fp32: fp32 wins."""
    seen = []

    def score(rc):
        seen.append((rc.dtype, rc.compute, rc.decode_compute))
        return 1.0 if rc.compute == rc.decode_compute == F32 else 10.0
    rc = rc_for((0, 0, 100, 0))
    got = dtype_choice.choose_dtypes(rc, "auto", "auto", probe=lambda: (timings("bfloat16"), True), score=score)
    assert got.compute == F32 and got.decode is None
    assert "the policy search's predicted time" in got.reason and "would not fit" not in got.reason
    assert {c for _, c, _ in seen} == {F32, BF16, F16}  # every option was scored


def test_options_where_nothing_fits_are_passed_over():
    """None (no plan fits) never wins, even where the probe ranks it first; all None: the probe's first."""
    rc, probe = rc_for((0, 0, 100, 0)), lambda: (timings("bfloat16"), True)
    got = dtype_choice.choose_dtypes(rc, "auto", "auto", probe=probe,
                                     score=lambda r: None if r.compute == BF16 else (2.0 if r.compute == F16 else 3.0))
    assert got.compute == F16
    got = dtype_choice.choose_dtypes(rc, "auto", "auto", probe=probe, score=lambda r: None)
    assert got.compute == BF16  # nothing fits anywhere: the probe's first, whose refusal the caller reports


def _avx2_profile() -> dict:
    """The shipped measured CPU profile with 16-bit matmuls ~130x slower than fp32 (an AVX2 CPU: fp16 0.87 GFLOP/s
    against fp32's 115 on a Zen 3), every other figure as measured."""
    hw = load_profile("cpu_measured")
    f32 = dict(hw)
    for key in ("matmul_flops", "decode_matmul_flops", "attention_flops", "decode_attention_flops"):
        if isinstance(hw.get(key), dict) and "float32" in hw[key]:
            f32[key] = {"float32": hw[key]["float32"], "bfloat16": hw[key]["float32"] / 130,
                        "float16": hw[key]["float32"] / 130}
    rows = (hw.get("matmul_flops_by_rows") or {}).get("float32")
    if rows:
        f32["matmul_flops_by_rows"] = {"float32": rows, "bfloat16": {k: v / 130 for k, v in rows.items()},
                                       "float16": {k: v / 130 for k, v in rows.items()}}
    return f32


def test_opt13b_in_fp32_on_the_avx2_path_where_it_fits():
    """opt-1.3b, 128 + 32, h2o 32 tokens, 900 MiB gpu / 55946082 B cpu tier: fp32 fits (the vocabulary table no
    longer converts whole: 830 MiB of buffers before, 805 now), and scored by the search on a profile where 16-bit
    matmuls crawl, fp32 wins though the probe (here: fp16 first) ranks it last."""
    hw = _avx2_profile()
    rc = RunConfig(model=from_name("opt-1.3b"), percent=Percent.parse([0, 0, 0, 0, 0, 100]), gpu_batch_size=1,
                   prompt_len=128, gen_len=32, gpu_mem=900 << 20, cpu_mem=55946082, disk_mem=100 << 30)

    def score(r):
        found = search(r, hw, limit=1)
        return 1.0 / found[0][1].total_throughput if found else None
    got = dtype_choice.choose_dtypes(rc, "auto", "auto", probe=lambda: (timings("float16"), True), score=score)
    assert got.compute == F32 and got.decode in (None, F32)
    assert search(rc.with_(dtype=got.dtype, compute_dtype=F32), hw, limit=1)
