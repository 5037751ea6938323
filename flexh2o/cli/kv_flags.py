"""The KV-cache flags shared by flexh2o-run, flexh2o-plan and flexh2o-eval, and the KVSpec they make. The policy
parameters' flags (--num-sinks, --hh-decay, --pyramid-ratio, --head-cap, ...) come from the policies' declarations
(kv/policies/params.py): a parameter declared on a policy class is a flag here with no change to this file."""
from __future__ import annotations

import argparse

from flexh2o.cli.checks import check_kv_flags
from flexh2o.kv.policies import POLICIES, policy_class, policy_params
from flexh2o.kv.spec import KVSpec


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


def add_kv_flags(p: argparse.ArgumentParser, budgets: bool = True) -> None:
    """Every policy parameter's flag (--num-sinks first: every script); with `budgets`, also --kv-policy,
    --hh-ratio, --recent-ratio, --kv-budget."""
    a = p.add_argument
    if budgets:
        a("--kv-policy", choices=PolicyNames(), default=None, help="default: h2o with --hh-ratio/--kv-budget, "
          "else full")
        a("--hh-ratio", type=float, help="heavy budget = int(ratio * prompt_len); recent the same")
        a("--recent-ratio", type=float, help="recent budget = int(ratio * prompt_len)")
        a("--kv-budget", type=int, help="total KV budget in tokens per sequence, layer and head")
    for param in policy_params():
        a(param.flag, type=param.type, default=param.default, help=param.help)


def policy_values(args: argparse.Namespace) -> dict:
    """Every policy parameter's value from parsed flags, by name (num_sinks, hh_decay, ...)."""
    return {param.name: getattr(args, param.name) for param in policy_params()}


def kv_spec(args: argparse.Namespace, prompt_len: int) -> KVSpec:
    """The run's KVSpec from parsed flags (the only place where --hh-ratio becomes token counts)."""
    check_kv_flags(args, args.kv_policy)
    return KVSpec.from_flags(args.kv_policy, prompt_len, args.hh_ratio, getattr(args, "recent_ratio", None),
                             args.kv_budget, seed=args.seed, **policy_values(args))
