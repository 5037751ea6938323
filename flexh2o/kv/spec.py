"""KVSpec: which KV policy a run uses and its parameters, in whole tokens (ratios are converted here, once)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from flexh2o.kv.policies import policy_class, policy_params
from flexh2o.kv.policies.base import DEFAULT_RECENT_SHARE, RECENT_SHARE, Budget, KVPolicy
from flexh2o.kv.policies.params import declared

LANES = "lanes"
# The fewest tokens a budget given as ratios (--hh-ratio/--recent-ratio, hh_ratio=) keeps in all, so that a short
# prompt keeps what it needs (20% of a 6-token prompt is 2 tokens); the paper's settings (prompts of 512+ tokens at
# 20%: 102 + 102) never reach it; --exact-ratio keeps the ratio, --kv-budget is obeyed exactly. Measured on the real
# SmolLM2-135M (2026-12-06, commit 84e1361, AMD EPYC Zen 4, 2 vCPU): h2o perplexity over 256-token windows against
# the full cache, hamlet / macbeth, at 32 tokens +35% / +33%, 48: +19% / +10%, 64: +8.7% / +5.6%, 96: +1.9% / +3.9%,
# 128: +0.6% / +2.2% (`flexh2o-eval ppl --model smollm2 --dtype float32 --context 256 --windows 2 --texts
# hamlet,macbeth --prefix 1 --policies h2o --budgets 8,16,24,32,48,64,96,128 --threads 1`; benchmarks/ACCURACY.md):
# below 64 perplexity leaves the full cache's neighbourhood fast (x2 per halving), at 64 it is within 10%.
RATIO_FLOOR = 64
LEGACY_POSITIONAL = ("hh_decay", "lanes", "pyramid_ratio", "head_cap")  # after seed, as KVSpec once took them


@dataclass(frozen=True, init=False)
class KVSpec:
    """policy: a name in kv.policies.POLICIES, or WRAPPER:POLICY (kv/policies/wrappers.py); budget: tokens per
    sequence, layer and KV head (None = unbounded); seed: for policies that draw at random; every parameter a policy
    declares (kv/policies/params.py: num_sinks, hh_decay, pyramid_ratio, head_cap, ...) as a keyword, read back as
    an attribute (spec.head_cap); `params` holds those that differ from their defaults, sorted.
    The per-layer budgets need the model's number of layers: slots, evicts and make take it (`num_layers`).
    lanes (policy "lanes"): ((rows, KVSpec), ...), each lane's spec for its own rows of one batch (see of_lanes)."""

    policy: str
    budget: Optional[Budget]
    seed: int
    lanes: tuple
    params: tuple

    def __init__(self, policy: str = "full", budget: Optional[Budget] = None, num_sinks: Optional[int] = None,
                 seed: int = 0, *legacy, lanes: tuple = (), params: tuple = (), **values):
        """num_sinks, then hh_decay, lanes, pyramid_ratio, head_cap may also come by position (after seed)."""
        named = dict(zip(LEGACY_POSITIONAL, legacy))
        lanes = named.pop("lanes", lanes)
        given = {**dict(params), **named, **values}
        if num_sinks is not None:
            given["num_sinks"] = num_sinks
        known = {p.name: p for p in policy_params()}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise TypeError(f"KVSpec got an unknown policy parameter {', '.join(unknown)}: the policies declare "
                            f"{', '.join(known)}")
        kept = tuple(sorted((k, v) for k, v in given.items() if v != known[k].default))
        for name, value in (("policy", policy), ("budget", budget), ("seed", seed), ("lanes", tuple(lanes)),
                            ("params", kept)):
            object.__setattr__(self, name, value)
        # every parameter's value, defaults included, read by __getattr__ (the policy search reads them very often)
        object.__setattr__(self, "_values", {**{k: p.default for k, p in known.items()}, **dict(kept)})
        self._check()

    def __getattr__(self, name: str):
        """A policy parameter's value (its default when not given)."""
        if name.startswith("_") or name in ("params", "policy", "budget", "seed", "lanes"):
            raise AttributeError(name)
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        param = next((p for p in policy_params() if p.name == name), None)
        if param is None:
            raise AttributeError(f"KVSpec has no attribute or policy parameter {name!r}")
        return dict(self.params).get(name, param.default)

    def values(self) -> dict:
        """Every declared parameter's value, defaults included."""
        return {p.name: getattr(self, p.name) for p in policy_params()}

    def _check(self) -> None:
        if self.policy == LANES:
            if not self.lanes or self.budget is not None or any(rows < 1 for rows, _ in self.lanes):
                raise ValueError("a lanes spec needs one or more (rows, KVSpec) lanes and no budget of its own")
            return
        if self.lanes:
            raise ValueError(f"only the {LANES!r} spec has lanes")
        cls = policy_class(self.policy)
        if self.policy == "full" and self.budget is not None:
            raise ValueError("--kv-policy full keeps every token: drop --hh-ratio/--kv-budget or pick another policy")
        if self.policy != "full" and self.budget is None:
            raise ValueError(f"KV policy {self.policy} needs a budget: give --kv-budget N or --hh-ratio R")
        for param in policy_params():
            param.check(getattr(self, param.name))
        sinks = self.num_sinks
        if cls.uses_sinks and not cls.windowed and self.budget.total <= sinks:
            raise ValueError(f"--kv-budget {self.budget.total} must exceed --num-sinks {sinks} for the "
                             f"{self.policy} policy")
        if cls.uses_sinks and cls.windowed and sinks > self.budget.heavy:
            raise ValueError(f"--num-sinks {sinks} exceeds the {self.budget.heavy} heavy tokens of the "
                             f"{self.policy} policy: lower --num-sinks or raise the budget")
        if cls.layered and (self.budget.recent if cls.windowed else 0) + sinks < 1:
            raise ValueError(f"the {self.policy} policy needs a recent window or sinks (every layer keeps them): "
                             "raise --recent-ratio or --num-sinks")

    @staticmethod
    def from_flags(policy: Optional[str], prompt_len: int, hh_ratio: Optional[float] = None,
                   recent_ratio: Optional[float] = None, kv_budget: Optional[int] = None, num_sinks: int = 4,
                   seed: int = 0, exact_ratio: bool = False, **params) -> "KVSpec":
        """The spec of --kv-policy/--hh-ratio/--recent-ratio/--kv-budget/--num-sinks/--seed and every policy
        parameter's flag (`params`, by name: hh_decay, pyramid_ratio, head_cap, ...).

        No --kv-policy: h2o when a budget is given, else full. --hh-ratio r: heavy = int(r * prompt_len), recent =
        heavy (or int(recent_ratio * prompt_len)), raised to RATIO_FLOOR in all unless exact_ratio. --kv-budget N:
        total N, of which the share --recent-share
        (`params`' recent_share, default 0.5: heavy = N // 2) is the recent window for the policies that keep one;
        all window otherwise."""
        budgeted = hh_ratio is not None or kv_budget is not None
        policy = chosen_policy(policy, budgeted)
        if policy == "full":
            if budgeted:
                raise ValueError("--kv-policy full keeps every token: drop --hh-ratio/--kv-budget or pick another "
                                 "policy")
            return KVSpec("full", None, num_sinks, seed, **params)
        share = params.get("recent_share", DEFAULT_RECENT_SHARE)
        budget = resolve_budget(policy, prompt_len, hh_ratio, recent_ratio, kv_budget, share, exact_ratio)
        return KVSpec(policy, budget, num_sinks, seed, **params)

    @staticmethod
    def of_total(policy: str, tokens: Optional[int], num_sinks: int = 4, seed: int = 0, **params) -> "KVSpec":
        """A spec at a total budget of `tokens` (None or policy full: unbounded)."""
        if policy == "full":
            return KVSpec("full", None, num_sinks, seed, **params)
        return KVSpec.from_flags(policy, 0, kv_budget=tokens, num_sinks=num_sinks, seed=seed, **params)

    @staticmethod
    def of_lanes(lanes: list) -> "KVSpec":
        """Lanes (rows, KVSpec) of one batch, in row order: each row runs its lane's policy and budget exactly as a
        run of that spec alone would. The batch must be one GPU batch, prefilled in one piece."""
        return KVSpec(LANES, lanes=tuple(lanes))

    @property
    def needs_scores(self) -> bool:
        """The policy accumulates attention probabilities (prefill then materialises them in fp32)."""
        if self.lanes:
            return any(spec.needs_scores for _, spec in self.lanes)
        return policy_class(self.policy).needs_scores

    def slots(self, prompt_len: int, gen_len: int, num_layers: Optional[int] = None) -> int:
        """Cache slots per sequence and KV head in every layer: the largest layer budget + 1 (the incoming token),
        or the whole sequence (the policy's `slots`: the one place that says it)."""
        return self.make(num_layers).slots(prompt_len, gen_len)

    def evicts(self, prompt_len: int, gen_len: int, num_layers: Optional[int] = None) -> bool:
        """Some layer of some lane evicts."""
        if self.lanes:
            return any(spec.evicts(prompt_len, gen_len, num_layers) for _, spec in self.lanes)
        return self.make(num_layers).evicts(prompt_len, gen_len)

    def make(self, num_layers: Optional[int] = None) -> KVPolicy:
        """The policy object (built once per engine); `num_layers`: the model's, for per-layer budgets."""
        if self.lanes:
            from flexh2o.kv.policies.lanes import LanePolicy  # torch: not at the top, which the flags' parser reads
            return LanePolicy([(rows, spec.make(num_layers)) for rows, spec in self.lanes])
        cls = policy_class(self.policy)
        own = {p.name: getattr(self, p.name) for p in declared(cls) if p.name != "num_sinks"}
        return cls(self.budget, self.num_sinks, self.seed, num_layers=num_layers, **own)

    def kv_budget_flag(self) -> Optional[int]:
        """N such that --kv-budget N gives this spec back, or ValueError when none does; None for full."""
        if self.lanes:
            raise ValueError("a lanes spec has no single --kv-budget")
        if self.budget is None:
            return None
        n = self.budget.total
        if KVSpec.of_total(self.policy, n, seed=self.seed, **dict(self.params)) != self:
            raise ValueError(f"KV budget heavy {self.budget.heavy} + recent {self.budget.recent} cannot be written "
                             f"as --kv-budget for policy {self.policy} (it splits a budget by --recent-share "
                             f"{self.recent_share})")
        return n

    def describe(self) -> str:
        if self.lanes:
            return "lanes: " + ", ".join(f"{rows} x {spec.describe()}" for rows, spec in self.lanes)
        if self.budget is None:
            return self.policy
        shown = "".join(f", {p.label} {getattr(self, p.name):g}" for p in declared(policy_class(self.policy))
                        if p.label)
        return f"{self.policy} (heavy {self.budget.heavy}, recent {self.budget.recent}{shown})"


def make_policy(name: str, budget: Optional[Budget], num_sinks: int = 4, seed: int = 0, *legacy,
                num_layers: Optional[int] = None, **params) -> KVPolicy:
    """A policy object from its parts (validated as a KVSpec). After seed, by position: hh_decay, num_layers,
    pyramid_ratio, head_cap (as make_policy once took them)."""
    named = dict(zip(("hh_decay", "num_layers", "pyramid_ratio", "head_cap"), legacy))
    num_layers = named.pop("num_layers", num_layers)
    return KVSpec(name, budget, num_sinks, seed, **named, **params).make(num_layers)


def chosen_policy(policy: Optional[str], budgeted: bool) -> str:
    """The run's policy: --kv-policy as given, else h2o when a budget flag (--hh-ratio, --kv-budget) is given, else
    full."""
    return policy or ("h2o" if budgeted else "full")


def resolve_budget(policy: str, prompt_len: int, hh_ratio: Optional[float] = None,
                   recent_ratio: Optional[float] = None, kv_budget: Optional[int] = None,
                   recent_share: float = DEFAULT_RECENT_SHARE, exact_ratio: bool = True) -> Optional[Budget]:
    """Ratios or a token budget -> whole token counts (None for full, or when no budget flag is given). A
    --kv-budget N of a windowed policy: recent = N - int((1 - recent_share) N) (0.5: heavy = N // 2), exactly.
    A budget from ratios: exactly the ratios with exact_ratio (the default here), else at least RATIO_FLOOR tokens
    in all (ratio_floor; KVSpec.from_flags' default, so every run's)."""
    RECENT_SHARE.check(recent_share)
    if policy == "full":
        return None
    if kv_budget is not None:
        if kv_budget < 1:
            raise ValueError(f"--kv-budget must be a positive number of tokens (got {kv_budget})")
        if _windowed(policy):
            heavy = int(kv_budget * (1.0 - recent_share) + 1e-9)  # 1 - 0.9 is 0.0999...: 100 tokens keep 10
            return Budget(heavy, kv_budget - heavy)
        return Budget(0, kv_budget)
    if recent_share != DEFAULT_RECENT_SHARE and hh_ratio is not None:
        raise ValueError(f"--recent-share {recent_share} splits a --kv-budget: with --hh-ratio give the window as "
                         "--recent-ratio instead")
    if hh_ratio is None:
        return None
    heavy, recent = ratio_tokens(prompt_len, hh_ratio, recent_ratio, exact_ratio=exact_ratio)
    if heavy + recent < 1:
        raise ValueError(f"--hh-ratio {hh_ratio} of a {prompt_len}-token prompt keeps no tokens: raise the ratio")
    if _windowed(policy):
        return Budget(heavy, recent)
    return Budget(0, heavy + recent)


def ratio_tokens(prompt_len: int, hh_ratio: float, recent_ratio: Optional[float] = None, *,
                 exact_ratio: bool) -> tuple:
    """The one rule from ratios of a prompt to tokens: (heavy, recent) = int(ratio * prompt_len) each (recent as
    heavy when not given); unless exact_ratio, raised to RATIO_FLOOR tokens in all (ratio_floor)."""
    heavy = int(hh_ratio * prompt_len)
    recent = heavy if recent_ratio is None else int(recent_ratio * prompt_len)
    if exact_ratio:
        return heavy, recent
    return ratio_floor(heavy, recent, hh_ratio, hh_ratio if recent_ratio is None else recent_ratio)


def ratio_floor(heavy: int, recent: int, hh_ratio: float, recent_ratio: float) -> tuple:
    """(heavy, recent) raised to RATIO_FLOOR tokens in all, split as the two ratios split it, when a ratio of a
    short prompt keeps fewer; unchanged otherwise."""
    if heavy + recent >= RATIO_FLOOR:
        return heavy, recent
    share = hh_ratio / (hh_ratio + recent_ratio) if hh_ratio + recent_ratio > 0 else 0.5
    heavy = int(RATIO_FLOOR * share + 1e-9)
    return heavy, RATIO_FLOOR - heavy


def _windowed(policy: str) -> bool:
    """The policy's budget is heavy + recent (a --kv-budget splits evenly); the others keep one window."""
    try:
        return policy_class(policy).windowed
    except ValueError:
        return False
