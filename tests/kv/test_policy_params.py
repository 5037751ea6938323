"""A policy's parameters are declared once, on its class (kv/policies/params.py): a toy policy with a new parameter,
defined in this file only and registered, is picked up by flexh2o-run's and flexh2o-eval's parsers (flag, default,
help, range check worded as the declaration says), the KVSpec (keyword, attribute, validation, the policy object),
describe, the eval options and the printed command line; it also wraps (pyramid:toy), with both parameters."""
from __future__ import annotations

import torch
import pytest

from flexh2o.config import from_name
from flexh2o.kv.policies import POLICIES, Budget, policy_params
from flexh2o.kv.policies.base import Observed
from flexh2o.kv.policies.h2o import H2OPolicy
from flexh2o.kv.policies.params import Param
from flexh2o.kv.spec import KVSpec
from flexh2o.placement import Percent
from flexh2o.run_config import RunConfig
from test_validation import _fails

TILT = Param("toy_tilt", float, 0.5, "toy policy: how much older tokens are favoured, in [0, 1] (default 0.5)",
             lo=0.0, hi=1.0, fix="a share, e.g. 0.25", label="tilt")


class ToyPolicy(H2OPolicy):
    """h2o whose priority adds toy_tilt / (1 + age): a rule that reads its own parameter."""

    name = "toy"
    params = (TILT,)

    def priority(self, pos, score, layer, cur_pos, v):
        return score + self.toy_tilt / (1 + (cur_pos.view(-1, 1, 1) - pos).clamp(min=0).float())


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(POLICIES, "toy", ToyPolicy)  # the one registration line a new policy adds
    return ToyPolicy


def test_toy_parameter_reaches_parsers_spec_and_command_line(toy, offload_dir):
    from flexh2o.cli import eval as eval_cli, run as cli
    from flexh2o.cli.kv_flags import kv_spec
    from flexh2o.tuning.search import command_line
    assert "toy_tilt" in {p.name for p in policy_params()}
    args = cli.build_parser().parse_args(["--model", "opt-125m", "--kv-policy", "toy", "--kv-budget", "8",
                                          "--toy-tilt", "0.25"])
    spec = kv_spec(args, 16)
    assert spec == KVSpec("toy", Budget(4, 4), toy_tilt=0.25) and spec.toy_tilt == 0.25
    assert spec.make(2).toy_tilt == 0.25 and spec.make(2).options()["toy_tilt"] == 0.25
    assert spec.describe() == "toy (heavy 4, recent 4, tilt 0.25)"
    assert KVSpec("toy", Budget(4, 4)).toy_tilt == 0.5  # the declared default
    rc = RunConfig(model=from_name("opt-125m"), percent=Percent(100, 0, 100, 0), gpu_batch_size=2, prompt_len=16,
                   gen_len=4, kv=spec, offload_dir=offload_dir)
    line = command_line(rc).split()
    assert line[line.index("--toy-tilt") + 1] == "0.25" and line[line.index("--kv-policy") + 1] == "toy"
    assert cli.build_parser().parse_args(line[1:]).toy_tilt == 0.25  # the printed line reads back
    ev = eval_cli.build_parser().parse_args(["ppl", "--policies", "toy", "--toy-tilt", "0.75"])
    assert ev.toy_tilt == 0.75
    eval_help = eval_cli.build_parser()._subparsers._group_actions[0].choices["ppl"].format_help()
    assert "--toy-tilt" in eval_help and "older tokens are favoured" in " ".join(eval_help.split())


def test_toy_parameter_is_validated_in_one_place(toy, capsys):
    from flexh2o.cli import run as cli
    with pytest.raises(ValueError, match=r"--toy-tilt must be between 0 and 1 \(got 2\)"):
        KVSpec("toy", Budget(4, 4), toy_tilt=2)
    with pytest.raises(TypeError, match="toy_tilt"):
        KVSpec("h2o", Budget(4, 4), toy_tilted=0.1)
    err = _fails(capsys, cli.main, ["--model", "opt-125m", "--prompt-len", "8", "--gen-len", "2", "--dry-run",
                                    "--kv-policy", "toy", "--kv-budget", "16", "--toy-tilt", "-1"])
    assert "--toy-tilt -1.0: must be a finite number in [0, 1]; a share, e.g. 0.25" in err


def test_toy_policy_runs_wrapped_and_in_eval(toy):
    """pyramid:toy: the toy rule and parameter under per-layer budgets; the eval's model carries the parameter to
    its specs."""
    from flexh2o.eval.common import EvalModel, spec_of
    spec = KVSpec("pyramid:toy", Budget(5, 3), toy_tilt=0.1, pyramid_ratio=0.25)
    policy = spec.make(2)
    assert (policy.toy_tilt, policy.pyramid_ratio) == (0.1, 0.25)
    assert [b.total for b in policy.layer_budgets()] == [9, 7]
    pos = torch.arange(6).view(1, 1, 6)
    prio = policy.priority(pos, torch.zeros(1, 1, 6), 0, torch.tensor([5]), Observed())
    assert torch.allclose(prio, 0.1 / (6 - pos.float()))
    model = EvalModel("_DUMMY_", from_name("opt-125m"), None, torch.float32, toy_tilt=0.3)
    assert spec_of(model, "toy", 8) == KVSpec("toy", Budget(4, 4), toy_tilt=0.3)
