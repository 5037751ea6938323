"""Cost model: predicted prefill and per-token decode time of a RunConfig on a hardware profile (pure Python): each
phase's step from tuning/step_cost.py (which says how a layer's seconds are charged), decode counted gen_len - 1
times. Throughput is FlexGen's: generated tokens (num_seqs x gen_len) / (prefill + decode).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from flexh2o.planning.memory_plan import MemoryPlan, plan_memory
from flexh2o.run_config import RunConfig
from flexh2o.tuning.hardware import Rates
from flexh2o.tuning.kernel_cost import kernel_forms
from flexh2o.tuning.overlap import contended
from flexh2o.tuning.step_cost import OPS, StepCost
from flexh2o.weights.forms import WeightForms

__all__ = ["OPS", "Prediction", "contended", "predict", "predict_with"]


@dataclass
class Prediction:
    """Predicted seconds and throughput; terms[phase][resource.what] in seconds (decode: per token)."""

    prefill_s: float
    decode_s_per_token: float
    decode_s: float
    total_s: float
    total_throughput: float
    prefill_throughput: float
    decode_throughput: float
    terms: dict = field(default_factory=dict)
    bytes: dict = field(default_factory=dict)  # tier -> kind -> bytes, from plan_memory
    bottleneck: dict = field(default_factory=dict)  # phase -> busiest resource

    def as_dict(self) -> dict:
        """The headline figures (for a JSON record)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("terms", "bytes")}


def predict(rc: RunConfig, hw: dict, plan: Optional[MemoryPlan] = None) -> Prediction:
    """Predicted prefill and decode time of `rc` on the hardware profile `hw` (a dict as flexh2o-profile writes).
    Decode steps computed in another dtype than prefill (rc.decode_dtype) take that dtype's rates."""
    rates = Rates.from_profile(hw, rc.compute)
    decode_rates = rates if rc.decode_compute == rc.compute else Rates.from_profile(hw, rc.decode_compute)
    forms = kernel_forms(rc, {"prefill": rates, "decode": decode_rates})
    plan = plan or plan_memory(rc, forms=forms)
    return predict_with(rc, rates, plan.bytes, decode_rates=decode_rates, forms=forms)


def predict_with(rc: RunConfig, rates: Rates, tier_bytes: dict, memo: Optional[dict] = None,
                 decode_rates: Optional[Rates] = None, forms: Optional[WeightForms] = None) -> Prediction:
    """predict() from parts a search computes once: the rates, the bytes per tier (memory plan), and a memo of
    weight layouts. A decode phase in its own dtype is the same model with that compute dtype and its rates.
    forms: how the weights reach the compute side (kernel_forms; by default chosen here)."""
    if forms is None:
        forms = kernel_forms(rc, {"prefill": rates, "decode": decode_rates or rates})
    m = StepCost(rc, rates, memo, forms)
    prefill, pre_terms, pre_busy = m.phase(prefill=True)
    md = m if rc.decode_compute == rc.compute else StepCost(rc.with_(compute_dtype=rc.decode_compute),
                                                          decode_rates or rates, memo, forms)
    per_token, dec_terms, dec_busy = md.phase(prefill=False)
    decode = per_token * (rc.gen_len - 1)  # FlexGen's decode phase: the tokens after the first
    total = prefill + decode
    n = rc.num_seqs
    return Prediction(prefill, per_token, decode, total, n * rc.gen_len / total, n * rc.prompt_len / prefill,
                      n / per_token, {"prefill": pre_terms, "decode": dec_terms},
                      {t: dict(kinds) for t, kinds in tier_bytes.items()},
                      {"prefill": pre_busy, "decode": dec_busy})
