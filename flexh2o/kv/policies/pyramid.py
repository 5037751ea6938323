"""Per-layer budgets (after PyramidKV, Cai et al. 2024): the wrapper `LayerBudgets` gives any scoring policy a
budget that shrinks linearly from the bottom layer to the top one; `pyramid` is it over mean_attn
(`pyramid:POLICY` over another scoring policy, e.g. `pyramid:tova`).

The wrapped policy keeps its priority and its protection, and the first `num_sinks` positions are protected too
(--num-sinks): P = (its `recent` window, when it has one) + num_sinks protected tokens in every layer.
Budget: B = `heavy` + `recent` tokens per sequence and KV head on average over the L layers (--kv-budget B); with a
recent window num_sinks <= heavy, without one num_sinks <= B. The X = L * (B - P) other tokens are shared out over the
layers in proportion to w_l = 1 + (r - 1) * l / (L - 1) (w_l = 1 when L = 1), r = --pyramid-ratio in [0, 1]:
layer 0 (the bottom) gets the largest share, the top layer r times it. In exact rational arithmetic, layer l's
share is x_l = X * w_l / sum(w); each layer gets floor(x_l), and the X - sum(floor) tokens left over go one each to
the layers with the largest fractional parts x_l - floor(x_l) (ties to the lower layer). Layer l's budget is
P + its share: heavy_l = num_sinks + share_l, recent as given (a policy without a window: total_l = P + share_l).
So every layer keeps at least its protected tokens, the budgets sum to L * B (the mean is B) and r = 1 is the
wrapped policy with protected sinks at B in every layer.
The cache allocates the largest layer budget (layer 0's) + 1 slots per row in every layer.

`pyramid`'s priority of the unprotected tokens (mean_attn): the sum of the attention probability every query gave
the token (summed over the query heads sharing the KV head, fp32) divided by c - p + 1, the number of queries that
saw a token at position p when the newest position is c. Lowest priority is evicted, ties evict the older position.
"""
from __future__ import annotations

from fractions import Fraction

from flexh2o.kv.policies.base import Budget, KVPolicy, cache_slots
from flexh2o.kv.policies.mean_attn import MeanAttentionPolicy
from flexh2o.kv.policies.params import Param

DEFAULT_PYRAMID_RATIO = 0.5  # the top layer's extra tokens over the bottom layer's
PYRAMID_RATIO = Param("pyramid_ratio", float, DEFAULT_PYRAMID_RATIO, "pyramid policy: the top layer's share of the "
                      "unprotected budget over the bottom layer's, in [0, 1]; 1 = the same budget in every layer "
                      f"(default {DEFAULT_PYRAMID_RATIO})", lo=0.0, hi=1.0,
                      fix="the top layer's share of the bottom layer's unprotected budget", label="ratio")


def pyramid_budgets(budget: Budget, num_layers: int, ratio: float, num_sinks: int, windowed: bool = True) -> tuple:
    """The Budget of every layer, bottom first (see the module docstring). windowed: the wrapped policy protects
    its `recent` window (else the budget is one total)."""
    if num_layers < 1:
        raise ValueError(f"the pyramid policy needs the number of layers (got {num_layers})")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"--pyramid-ratio must be between 0 and 1 (got {ratio})")
    protected = (budget.recent if windowed else 0) + num_sinks
    if protected < 1:
        raise ValueError("the pyramid policy needs a recent window or sinks: every layer keeps its protected tokens")
    extra = num_layers * (budget.total - protected)
    if extra < 0:
        held = f"{budget.heavy} heavy tokens" if windowed else f"budget of {budget.total} tokens"
        raise ValueError(f"--num-sinks {num_sinks} exceeds the {held} of the pyramid policy")
    r, steps = Fraction(ratio), max(1, num_layers - 1)
    weights = [1 + (r - 1) * Fraction(layer, steps) for layer in range(num_layers)]
    shares = [extra * w / sum(weights) for w in weights]
    whole = [int(x) for x in shares]  # floor: every share is >= 0
    by_fraction = sorted(range(num_layers), key=lambda layer: (-(shares[layer] - whole[layer]), layer))
    for layer in by_fraction[:extra - sum(whole)]:
        whole[layer] += 1
    if windowed:
        return tuple(Budget(num_sinks + n, budget.recent) for n in whole)
    return tuple(Budget(0, num_sinks + n) for n in whole)


class LayerBudgets(KVPolicy):
    """The wrapper: put it before a scoring policy's class (kv/policies/wrappers.py composes them)."""

    wrapper = "pyramid"
    uses_sinks = True
    layered = True
    params = (PYRAMID_RATIO,)

    def layer_budgets(self) -> tuple:
        if self.num_layers is None:
            raise ValueError("the pyramid policy needs the model's number of layers")
        if getattr(self, "_budgets", None) is None:  # exact fractions: computed once (the fields are set once in
            # KVPolicy.__init__), asked at every step and layer
            self._budgets = pyramid_budgets(self.budget, self.num_layers, self.pyramid_ratio, self.num_sinks,
                                            self.windowed)
        return self._budgets

    def layer_budget(self, layer: int) -> Budget:
        return self.layer_budgets()[layer]

    def slots(self, prompt_len: int, gen_len: int) -> int:
        return max(cache_slots(b, prompt_len, gen_len) for b in self.layer_budgets())

    def evicts(self, prompt_len: int, gen_len: int) -> bool:
        return min(cache_slots(b, prompt_len, gen_len) for b in self.layer_budgets()) < prompt_len + gen_len


class PyramidPolicy(LayerBudgets, MeanAttentionPolicy):
    name = "pyramid"
