"""The KV-cache flags shared by flexh2o-run, flexh2o-plan and flexh2o-eval, and the KVSpec they make. The policy
parameters' flags (--num-sinks, --hh-decay, --pyramid-ratio, --head-cap, ...) come from the policies' declarations
(kv/policies/params.py): a parameter declared on a policy class is a flag here with no change to this file."""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from flexh2o.cli.checks import check_kv_flags
from flexh2o.cli.flags import Flag, add_flags
from flexh2o.kv.policies import POLICIES, policy_class, policy_params
from flexh2o.kv.spec import RATIO_FLOOR, KVSpec, ratio_tokens


class PolicyNames:
    """--kv-policy's choices: lists the policies (POLICIES, as --help shows them) and also holds every WRAPPER:POLICY
    name (kv/policies/wrappers.py), e.g. pyramid:tova."""

    def __iter__(self):
        return iter(sorted(POLICIES))

    def __contains__(self, name) -> bool:
        try:
            policy_class(name)
        except ValueError:
            return False
        return True


def kv_flags(budgets: bool = True) -> tuple:
    """The Flags of the KV cache: with `budgets`, --kv-policy, --hh-ratio, --recent-ratio, --kv-budget and
    --exact-ratio; then every policy parameter's (--num-sinks first: every script)."""
    head = (
        Flag("--kv-policy", choices=PolicyNames(), default=None, help="default: h2o with --hh-ratio/--kv-budget, "
             "else full"),
        Flag("--hh-ratio", type=float, help="heavy budget = int(ratio * prompt_len); recent the same; together at "
             f"least {RATIO_FLOOR} tokens unless --exact-ratio"),
        Flag("--recent-ratio", type=float, help="recent budget = int(ratio * prompt_len)"),
        Flag("--kv-budget", type=int, help="total KV budget in tokens per sequence, layer and head, obeyed exactly "
             f"(one warning line under {RATIO_FLOOR})"),
        Flag("--exact-ratio", action="store_true", help="keep exactly --hh-ratio/--recent-ratio of the prompt, even "
             f"below the {RATIO_FLOOR} tokens a budget from ratios otherwise keeps at least (for reproductions)"),
    ) if budgets else ()
    return head + tuple(Flag(p.flag, type=p.type, default=p.default, help=p.help) for p in policy_params())


def add_kv_flags(p: argparse.ArgumentParser, budgets: bool = True) -> None:
    """kv_flags(budgets) added to parser `p`."""
    add_flags(p, kv_flags(budgets))


def policy_values(args: argparse.Namespace) -> dict:
    """Every policy parameter's value from parsed flags, by name (num_sinks, hh_decay, ...)."""
    return {param.name: getattr(args, param.name) for param in policy_params()}


def kv_spec(args: argparse.Namespace, prompt_len: int) -> KVSpec:
    """The run's KVSpec from parsed flags (kv/spec.py turns --hh-ratio into token counts); a note on stderr when
    the floor raised a budget from ratios."""
    check_kv_flags(args, args.kv_policy)
    exact = getattr(args, "exact_ratio", False)
    if exact and args.hh_ratio is None:
        raise ValueError("--exact-ratio keeps --hh-ratio's share of the prompt exactly: give --hh-ratio too")
    flags = (args.kv_policy, prompt_len, args.hh_ratio, getattr(args, "recent_ratio", None), args.kv_budget)
    spec = KVSpec.from_flags(*flags, seed=args.seed, exact_ratio=exact, **policy_values(args))
    if args.hh_ratio is not None and not exact and spec.budget is not None:
        given = sum(ratio_tokens(*flags[1:4], exact_ratio=True))
        if given != spec.budget.total:
            print(f"kv budget: ratio {args.hh_ratio:g} of a {prompt_len}-token prompt keeps {given} tokens; kept "
                  f"{spec.budget.total} (the floor of a budget from ratios; --exact-ratio / exact_ratio=True keeps "
                  "the ratio)", file=sys.stderr)
    return spec


def budget_warning(kv_budget: Optional[int], name: str = "--kv-budget") -> Optional[str]:
    """One warning line for a token budget under RATIO_FLOOR (it is obeyed as given), else None."""
    if kv_budget is None or kv_budget >= RATIO_FLOOR or kv_budget < 1:
        return None
    return (f"warning: {name} {kv_budget} is under {RATIO_FLOOR} tokens, below which perplexity leaves the full "
            "cache's neighbourhood on a real model (benchmarks/ACCURACY.md); kept as given")
