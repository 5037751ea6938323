"""A policy parameter's flag set to a value the run's policy never reads is refused in one line (exit 2) naming the
policies that read it, instead of being ignored without a word; a parameter some chosen policy reads (flexh2o-eval:
any of its --policies), or given at its default, is accepted."""
from __future__ import annotations

import pytest

from flexh2o.cli import eval as eval_cli, run as cli
from flexh2o.kv.policies.a2sf import HH_DECAY
from test_validation import _fails

RUN = ["--model", "opt-125m", "--prompt-len", "8", "--gen-len", "2", "--dry-run"]


@pytest.mark.parametrize("argv, needles", [
    (["--kv-budget", "16", "--hh-decay", "0.5"], ["--hh-decay 0.5: the h2o policy does not read it", "a2sf"]),
    (["--num-sinks", "2"], ["--num-sinks 2: the full policy does not read it", "streaming"]),
    (["--kv-policy", "tova", "--kv-budget", "16", "--recent-share", "0.2"], ["the tova policy", "mean_attn"]),
    (["--kv-policy", "pyramid:tova", "--kv-budget", "16", "--head-cap", "3"], ["--head-cap 3.0", "adakv"]),
])
def test_run_refuses_a_parameter_its_policy_does_not_read(capsys, argv, needles):
    _fails(capsys, cli.main, RUN + argv, *needles)


@pytest.mark.parametrize("argv", [
    ["--kv-policy", "a2sf", "--kv-budget", "16", "--hh-decay", "0.5"],
    ["--kv-policy", "pyramid:tova", "--kv-budget", "16", "--pyramid-ratio", "0.25"],
    ["--kv-policy", "vatp", "--kv-budget", "16", "--num-sinks", "2", "--recent-share", "0.25"],
    ["--kv-budget", "16", "--num-sinks", "4", "--hh-decay", str(HH_DECAY.default)],  # defaults: nothing ignored
])
def test_run_accepts_a_parameter_its_policy_reads(capsys, argv):
    assert cli.main(RUN + argv) == 0
    assert "error" not in capsys.readouterr().err


def test_eval_checks_its_policies_together(capsys):
    from flexh2o.cli.eval import _settings
    _fails(capsys, eval_cli.main, ["ppl", "--policies", "h2o,tova", "--num-sinks", "2"],
           "none of the policies h2o, tova reads it", prog="flexh2o-eval")
    args = eval_cli.build_parser().parse_args(["ppl", "--policies", "h2o,vatp", "--num-sinks", "2", "--out",
                                               "/dev/null"])
    assert _settings(args).policies == ("h2o", "vatp")  # vatp reads it
