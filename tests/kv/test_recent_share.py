"""--recent-share: the share of a total budget (--kv-budget, flexh2o-eval's budgets) that the windowed policies keep
as their recent window, the rest heavy hitters. The default (0.5) is H2O's even split, heavy = N // 2 exactly as
before the flag; the printed command line carries a share it did not default; a share beside --hh-ratio (whose window
--recent-ratio sets) and a share outside [0, 1] are refused in one line; the eval runs a lane at that split."""
from __future__ import annotations

import pytest
import torch

from flexh2o.cli import eval as eval_cli, run as cli
from flexh2o.cli.kv_flags import kv_spec
from flexh2o.config import ModelConfig, from_name
from flexh2o.kv.policies import Budget
from flexh2o.kv.spec import KVSpec
from flexh2o.placement import Percent
from flexh2o.run_config import RunConfig
from test_validation import _fails

RUN = ["--model", "opt-125m", "--prompt-len", "8", "--gen-len", "2", "--dry-run"]


def test_default_split_is_even_and_a_share_splits_the_total():
    for n in range(1, 300):
        assert KVSpec.from_flags("h2o", 64, kv_budget=n).budget == Budget(n // 2, n - n // 2)
    assert KVSpec.from_flags("mean_attn", 0, kv_budget=425, recent_share=0.1).budget == Budget(382, 43)
    assert KVSpec.from_flags("vatp", 0, kv_budget=100, recent_share=0.9).budget == Budget(10, 90)  # not 91
    assert KVSpec.from_flags("h2o", 0, kv_budget=10, recent_share=0.0).budget == Budget(10, 0)
    assert KVSpec.from_flags("h2o", 0, kv_budget=10, recent_share=1.0).budget == Budget(0, 10)
    assert KVSpec.of_total("pyramid:tova", 40, recent_share=0.25).budget == Budget(0, 40)  # tova keeps no window
    with pytest.raises(ValueError, match=r"--recent-share must be between 0 and 1 \(got 1.5\)"):
        KVSpec.from_flags("h2o", 0, kv_budget=10, recent_share=1.5)


def test_share_reaches_the_run_and_its_printed_command_line(offload_dir):
    from flexh2o.tuning.search import command_line

    def spec_and_line(*flags):  # the KVSpec of `flags` at a 16-token prompt, and the command line printed for it
        spec = kv_spec(cli.build_parser().parse_args(["--model", "opt-125m", *flags]), 16)
        rc = RunConfig(model=from_name("opt-125m"), percent=Percent(100, 0, 100, 0), gpu_batch_size=2,
                       prompt_len=16, gen_len=4, kv=spec, offload_dir=offload_dir)
        return spec, command_line(rc).split()

    spec, line = spec_and_line("--kv-policy", "mean_attn", "--kv-budget", "20", "--recent-share", "0.25")
    assert spec.budget == Budget(15, 5) and spec.recent_share == 0.25
    assert line[line.index("--recent-share") + 1] == "0.25"
    assert kv_spec(cli.build_parser().parse_args(line[1:]), 16) == spec  # the printed line reads back
    assert "--recent-share" not in spec_and_line("--kv-budget", "20")[1]


def test_bad_shares_are_refused_in_one_line(capsys):
    err = _fails(capsys, cli.main, RUN + ["--hh-ratio", "0.2", "--recent-share", "0.3"])
    assert "--recent-share 0.3 splits a --kv-budget" in err and "--recent-ratio" in err
    err = _fails(capsys, cli.main, RUN + ["--kv-budget", "16", "--recent-share", "-0.1"])
    assert "--recent-share -0.1: must be a finite number in [0, 1]" in err
    _fails(capsys, eval_cli.main, ["ppl", "--policies", "h2o", "--recent-share", "2"], "--recent-share 2.0",
           prog="flexh2o-eval")


def test_eval_lane_runs_at_the_share():
    """A lane of flexh2o-eval at --recent-share 0.25 is the run of the explicit split; it differs from the even one."""
    from flexh2o.eval.common import EvalModel, _forced, forced_run, spec_of
    cfg = ModelConfig("tiny-llama", "llama", hidden=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn=128,
                      vocab=1000, max_positions=256, tie_embeddings=False)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 1000, (n,), generator=g).tolist() for n in (12, 7)]
    targets = torch.randint(4, 1000, (2, 24), generator=g)
    model = EvalModel("_DUMMY_", cfg, tokenizer=None, dtype=torch.float32, recent_share=0.25)
    assert spec_of(model, "h2o", 12).budget == Budget(9, 3)
    shared = forced_run(model, "h2o", 12, prompts, targets)
    explicit = _forced(model, KVSpec("h2o", Budget(9, 3)), prompts, targets, None, 1)
    torch.testing.assert_close(shared.logprob, explicit.logprob, atol=0, rtol=0)
    even = forced_run(EvalModel("_DUMMY_", cfg, tokenizer=None, dtype=torch.float32), "h2o", 12, prompts, targets)
    assert not torch.equal(even.logprob, shared.logprob)
