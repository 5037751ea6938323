"""Compute-side memory bounded by what a step touches (weights/on_use.py): on the AVX2 path, opt-1.3b streamed from
disk under a 480 MiB gpu tier computes in fp32 where the profile multiplies 16-bit dtypes far slower (its decoder
layers converted whole needed 589.7 MiB there, so a 2-byte compute dtype was forced), the dtype still follows the
profile where 16-bit is the fast one, and the cost model charges weights converted on use once per use."""
from __future__ import annotations

import json

import pytest
import torch

from flexh2o.cli import run as cli
from flexh2o.compress.choice import PHASES
from flexh2o.planning import dtype_choice
from flexh2o.run_config import RunConfig
from flexh2o.tuning.cost_model import predict_with
from flexh2o.tuning.hardware import Rates, load_profile
from flexh2o.weights.forms import WeightForms
from flexh2o.weights.on_use import uses_a_step

from test_dtype_choice import timings
from test_dtype_score import _avx2_profile
from test_on_use import MID

DRY_RUN = ["--model", "opt-1.3b", "--prompt-len", "128", "--gen-len", "32", "--kv-policy", "h2o", "--kv-budget",
           "32", "--gpu-mem", "503514729", "--cpu-mem", "55946082", "--policy", "auto", "--dry-run"]


def _sixteen_fast(hw: dict) -> dict:
    """The AVX2 profile the other way round: 16-bit matmuls 130x faster than fp32 (a CPU with bf16 units)."""
    out = dict(hw)
    for key, val in hw.items():
        if isinstance(val, dict) and set(val) == {"float32", "bfloat16", "float16"}:
            out[key] = {"float32": val["bfloat16"], "bfloat16": val["float32"], "float16": val["float32"]}
    return out


@pytest.mark.parametrize("fast", ["float32", "bfloat16"])
def test_the_dry_run_at_480_mib_follows_the_profile(tmp_path, monkeypatch, capsys, fast):
    """The dry run at --gpu-mem 503514729 on an injected profile (and dtype probe) where `fast` multiplies 130x
    faster: fp32 fast -> fp32 compute, its plan converting the blocks' matmul weights on use and fitting the cap
    (bf16/bf16 before: fp32 did not fit); 16-bit fast -> a 16-bit compute dtype (no dtype is hard-coded)."""
    hw = _avx2_profile() if fast == "float32" else _sixteen_fast(_avx2_profile())
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(hw))
    monkeypatch.setattr(dtype_choice, "cached_probe", lambda: (timings(fast, slow=130.0), True))
    assert cli.main(DRY_RUN + ["--hardware", str(path)]) == 0
    out = capsys.readouterr()
    chosen = [ln for ln in out.err.splitlines() if ln.startswith("--policy auto:")]
    assert len(chosen) == 1 and "(predicted" in chosen[0], out.err
    lines = out.out.splitlines()
    assert "fits" in lines, out.out
    if fast == "float32":
        assert "--compute-dtype float32" in chosen[0] and "float32 compute" in out.out
        assert any(ln.startswith("matmul weights converted on use") for ln in lines), out.out
    else:
        assert "--compute-dtype float32" not in chosen[0] and "float32 compute" not in out.out


def test_weights_converted_on_use_are_charged_at_every_use():
    """The cost model's conversion seconds with the weights converted on use exceed those converting whole layers
    by (uses - 1) x their stored bytes at the profile's conversion rate, per layer and phase: uses are the GPU
    batches, times the prefill sub-batches in a decoder layer's prefill."""
    rc = RunConfig(model=MID, gpu_batch_size=8, num_gpu_batches=3, prompt_len=16, gen_len=4, dtype=torch.bfloat16,
                   compute_dtype=torch.float32, prefill_batch=3)  # 3 sub-batches of 3, 3 and 2 sequences
    rates = Rates.from_profile(load_profile("cpu_measured"), torch.float32)
    whole = WeightForms.of_run(rc)
    on_use = whole.with_on_use(PHASES)
    assert uses_a_step(rc, 1, True) == 9 and uses_a_step(rc, 1, False) == 3 and uses_a_step(rc, 3, True) == 3
    got = {f: predict_with(rc, rates, {}, forms=f).terms for f in (whole, on_use)}
    for phase in PHASES:
        prefill = phase == "prefill"
        extra = sum((uses_a_step(rc, layer, prefill) - 1) * n
                    for layer, n in enumerate(on_use.on_use_bytes(rc.placement.weights, phase)))
        assert extra > 0
        diff = got[on_use][phase]["compute.convert_weights"] - got[whole][phase]["compute.convert_weights"]
        assert diff == pytest.approx(extra / rates.convert, rel=1e-9)  # float sums in another order
