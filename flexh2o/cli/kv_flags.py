"""The KV-cache flags shared by flexh2o-run, flexh2o-plan and flexh2o-eval, and the KVSpec they make."""
from __future__ import annotations

import argparse

from flexh2o.cli.checks import check_kv_flags
from flexh2o.kv.policies import DEFAULT_DECAY, DEFAULT_HEAD_CAP, DEFAULT_PYRAMID_RATIO, POLICIES
from flexh2o.kv.spec import KVSpec


def add_kv_flags(p: argparse.ArgumentParser, budgets: bool = True) -> None:
    """--num-sinks (every script); with `budgets`, also --kv-policy, --hh-ratio, --recent-ratio, --kv-budget."""
    a = p.add_argument
    if budgets:
        a("--kv-policy", choices=sorted(POLICIES), default=None, help="default: h2o with --hh-ratio/--kv-budget, "
          "else full")
        a("--hh-ratio", type=float, help="heavy budget = int(ratio * prompt_len); recent the same")
        a("--recent-ratio", type=float, help="recent budget = int(ratio * prompt_len)")
        a("--kv-budget", type=int, help="total KV budget in tokens per sequence, layer and head")
    a("--num-sinks", type=int, default=4, help="attention sinks kept by the policies that protect them "
      "(streaming, vatp, h2o_sinks, mean_vnorm; default 4)")
    a("--hh-decay", type=float, default=DEFAULT_DECAY, help="forgetting factor of the a2sf policy's scores, in "
      f"(0, 1]; 1 = h2o (default {DEFAULT_DECAY})")
    a("--pyramid-ratio", type=float, default=DEFAULT_PYRAMID_RATIO, help="pyramid policy: the top layer's share "
      "of the unprotected budget over the bottom layer's, in [0, 1]; 1 = the same budget in every layer "
      f"(default {DEFAULT_PYRAMID_RATIO})")
    a("--head-cap", type=float, default=DEFAULT_HEAD_CAP, help="adakv policy: the most tokens one KV head may hold, "
      f"in per-head budgets, >= 1 (default {DEFAULT_HEAD_CAP})")


def kv_spec(args: argparse.Namespace, prompt_len: int) -> KVSpec:
    """The run's KVSpec from parsed flags (the only place where --hh-ratio becomes token counts)."""
    check_kv_flags(args, args.kv_policy)
    return KVSpec.from_flags(args.kv_policy, prompt_len, args.hh_ratio, getattr(args, "recent_ratio", None),
                             args.kv_budget, args.num_sinks, args.seed, args.hh_decay, args.pyramid_ratio,
                             args.head_cap)
