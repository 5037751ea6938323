"""Per-phase compute dtype: decode steps may compute in the bfloat16 storage dtype straight from the stored weights
while prefill converts them once and computes in fp32 (planning/dtype_choice.py decides by the probe; the engine
loads each step's weights in that step's dtype; the cost model prices each phase in its own dtype)."""
from __future__ import annotations

import torch

from conftest import hf_opt, ragged_prompts
from flexh2o.config import ModelConfig
from flexh2o.engine import Engine
from flexh2o.placement import Percent
from flexh2o.planning import dtype_choice
from flexh2o.tuning.cost_model import predict
from flexh2o.tuning.hardware import load_profile
from flexh2o.run_config import RunConfig
from flexh2o.weights.store import WeightStore
from test_dtype_choice import rc_for

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
TINY = ModelConfig("tiny", "opt", hidden=64, num_layers=3, num_heads=4, ffn=256, vocab=1000, max_positions=128)


def probe(decode_bf16: float, convert: float = 0.004) -> dict:
    """Fake probe timings: fp32 is the fast prefill dtype; a bf16 decode step costs `decode_bf16` against fp32's
    0.010 plus `convert` to widen bf16 weights."""
    names = ("float32", "bfloat16", "float16")
    return {"decode": {"float32": 0.010, "bfloat16": decode_bf16, "float16": 0.050},
            "prefill": {"float32": 0.002, "bfloat16": 0.030, "float16": 0.030},
            "convert": {f"{a}->{b}": convert for a in names for b in names if a != b}}


def test_bf16_storage_decodes_in_bf16_when_the_probe_says_it_pays():
    got = dtype_choice.choose_dtypes(rc_for(), "bfloat16", "auto", probe=lambda: (probe(0.011), True))
    assert (got.dtype, got.compute, got.decode) == (BF16, F32, BF16)
    assert "decode steps in bfloat16 straight from the stored weights" in got.reason


def test_bf16_storage_converts_for_decode_when_that_is_faster():
    got = dtype_choice.choose_dtypes(rc_for(), "bfloat16", "auto", probe=lambda: (probe(0.030), True))
    assert (got.dtype, got.compute, got.decode) == (BF16, F32, None)


def test_explicit_compute_dtype_fixes_both_phases():
    got = dtype_choice.choose_dtypes(rc_for(), "bfloat16", "float32", probe=lambda: (probe(0.001), True))
    assert (got.compute, got.decode) == (F32, None)


def test_float16_storage_never_decodes_in_float16_unasked():
    t = probe(0.011)
    t["decode"]["float16"] = 0.001  # even when the probe finds it fastest: fp16's range is narrower than fp32's
    got = dtype_choice.choose_dtypes(rc_for(), "float16", "auto", probe=lambda: (t, True))
    assert got.decode is None and got.compute == F32


def test_large_batches_decode_in_fp32_because_bf16_does_not_get_cheaper_per_row():
    rc = rc_for().with_(gpu_batch_size=64)
    got = dtype_choice.choose_dtypes(rc, "bfloat16", "auto", probe=lambda: (probe(0.011), True))
    assert got.decode is None


def _rc(offload_dir, **kw):
    return RunConfig(model=TINY, percent=Percent.parse([0, 100, 100, 0]), gpu_batch_size=3, prompt_len=10,
                     gen_len=5, dtype=BF16, compute_dtype=F32, offload_dir=offload_dir, **kw)


def test_engine_loads_prefill_weights_in_fp32_and_decode_weights_as_stored(offload_dir, monkeypatch):
    seen = []
    real = WeightStore.load_layer

    def spy(self, layer, device, dtype, *args, **kw):
        tensors, copied = real(self, layer, device, dtype, *args, **kw)
        seen.append((dtype, copied, {t.dtype for t in tensors.values()}))
        return tensors, copied
    monkeypatch.setattr(WeightStore, "load_layer", spy)
    prompts = ragged_prompts(3, 10, TINY.vocab, seed=2)
    with Engine(_rc(offload_dir, decode_dtype=BF16, overlap=False)) as eng:  # loads in plan order
        eng.generate(prompts, 5)
    layers = TINY.num_layers + 2
    prefill, decode = seen[:layers], seen[layers:]
    assert all(d == F32 and kinds == {F32} and copied > 0 for d, copied, kinds in prefill)
    assert decode and all(d == BF16 and kinds == {BF16} and copied == 0 for d, copied, kinds in decode)


def test_bf16_decode_logits_match_transformers_in_bf16(offload_dir):
    """Every decode step's logits against OPTForCausalLM in bfloat16 on the same bf16 weights, fed the engine's
    tokens (teacher forcing): within bf16 rounding (the engine's prefill ran in fp32, so not bitwise)."""
    prompts = ragged_prompts(3, 10, TINY.vocab, seed=3)
    rc = _rc(offload_dir, decode_dtype=BF16)
    with Engine(rc) as eng:
        gen = eng.generate(prompts, 5, record_logits=True)
        weights = {k: v.clone() for k, v in eng.weights.handles.items()}
    with Engine(_rc(offload_dir)) as eng:  # the same weights with fp32 decode: the switch must change something
        gen32 = eng.generate(prompts, 5, record_logits=True)
    model = hf_opt(TINY, {k: v.float() for k, v in weights.items()}).to(BF16)
    for i, p in enumerate(prompts):
        ids = torch.tensor([p + gen.tokens[i].tolist()[:-1]])
        with torch.no_grad():
            ref = model(ids).logits[0, len(p) - 1:].float()  # the logits that chose each generated token
        for step in range(1, 5):
            got = gen.step_logits[step][i]
            err = (got - ref[step]).norm() / ref[step].norm()
            assert err < 0.03, (i, step, float(err))
    assert any(not torch.equal(a, b) for a, b in zip(gen.step_logits[-1], gen32.step_logits[-1]))
    assert all(torch.equal(a, b) for a, b in zip(gen.step_logits[0], gen32.step_logits[0]))  # prefill alike


def test_cost_model_prices_decode_in_its_own_dtype_without_a_conversion():
    hw = load_profile("cpu_measured")
    for key in ("matmul_flops", "decode_matmul_flops", "attention_flops", "decode_attention_flops",
                "matmul_flops_by_rows"):
        if isinstance(hw.get(key), dict) and "float32" in hw[key]:
            hw[key].setdefault("bfloat16", hw[key]["float32"])
    rc = rc_for().with_(dtype=BF16, compute_dtype=F32)
    both = predict(rc, hw)
    split = predict(rc.with_(decode_dtype=BF16), hw)
    assert both.terms["decode"].get("compute.convert_weights", 0) > 0
    assert split.terms["decode"].get("compute.convert_weights", 0) == 0
    assert split.terms["prefill"]["compute.convert_weights"] == both.terms["prefill"]["compute.convert_weights"]
    assert split.decode_s_per_token < both.decode_s_per_token
