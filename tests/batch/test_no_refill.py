"""--no-refill (cli/request_job.py), and `no_refill=True` for the API through the same declaration: a request job
answered in FlexGen's fixed rounds of num_seqs requests instead of refilling finished rows; its answers equal the
refilled run's (each request's greedy tokens do not depend on which rows share its batch)."""
from __future__ import annotations

import pytest
import torch

from flexh2o import LLM, SamplingParams
from flexh2o.batch import run as batch_run
from flexh2o.cli import run as cli
from request_helpers import read_jsonl, write_jsonl
from tiny_models import write_tiny_checkpoint

pytest.importorskip("tokenizers")
MAX = (3, 9, 5, 2, 7, 4, 6)  # ragged answers: rows of one round finish at different steps


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("norefill") / "ckpt"))


def _prompts() -> list:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(4, 200, (int(n),), generator=g).tolist() for n in (4, 7, 2, 5, 6, 3, 8)]


def _cli(ckpt, tmp_path, off, name, capsys, *extra) -> tuple:
    rows = write_jsonl(tmp_path / f"{name}.jsonl", [{"id": str(i), "prompt_ids": p, "max_new_tokens": m}
                                                    for i, (p, m) in enumerate(zip(_prompts(), MAX))])
    out = tmp_path / f"{name}-out.jsonl"
    capsys.readouterr()
    assert cli.main(["--path", ckpt, "--prompt-file", rows, "--output-file", str(out), "--gpu-batch-size", "2",
                     "--offload-dir", off, "--no-warmup", "--verbose", "1", "--ignore-eos", *extra]) == 0
    summary = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("requests ")]
    return {r["id"]: r for r in read_jsonl(out)}, summary[-1]


def test_cli_no_refill_runs_fixed_rounds_with_the_same_answers(ckpt, tmp_path, offload_dir, capsys):
    refilled, said = _cli(ckpt, tmp_path, offload_dir, "refill", capsys)
    fixed, said_fixed = _cli(ckpt, tmp_path, offload_dir, "fixed", capsys, "--no-refill")
    assert said.startswith("requests 7 on 2 refilled rows")  # one run whose 2 rows take the requests in turn
    assert said_fixed.startswith("requests 7 in 4 rounds")  # ceil(7 / 2) rounds of the GPU batch
    assert fixed == refilled and [len(fixed[str(i)]["token_ids"]) for i in range(7)] == list(MAX)


def _said_before(ckpt, tmp_path, off, capsys, *extra) -> list:
    """The lines flexh2o-run prints on stderr before a job of the 7 requests on 2 rows."""
    rows = write_jsonl(tmp_path / "said.jsonl", [{"id": str(i), "prompt_ids": p, "max_new_tokens": m}
                                                 for i, (p, m) in enumerate(zip(_prompts(), MAX))])
    capsys.readouterr()
    assert cli.main(["--path", ckpt, "--prompt-file", rows, "--output-file", str(tmp_path / "said-out.jsonl"),
                     "--gpu-batch-size", "2", "--offload-dir", off, "--no-warmup", "--verbose", "0",
                     "--ignore-eos", *extra]) == 0
    return [ln for ln in capsys.readouterr().err.splitlines() if "--gpu-batch-size x --num-gpu-batches" in ln]


def test_cli_says_rows_are_refilled_not_rounds(ckpt, tmp_path, offload_dir, capsys):
    """Before the job: refilled rows have no rounds (the line said '7 prompts run in 4 rounds'); --no-refill's
    fixed rounds are named as such; a resumed job counts only the requests still to answer."""
    (refilled,) = _said_before(ckpt, tmp_path, offload_dir, capsys)
    assert "rounds of" not in refilled and "7 requests run on 2 rows" in refilled and "next request" in refilled
    (tmp_path / "said-out.jsonl").unlink()
    assert _said_before(ckpt, tmp_path, offload_dir, capsys, "--no-refill") == [
        "flexh2o-run: 7 requests run in 4 rounds of 2 sequences (--gpu-batch-size x --num-gpu-batches)"]
    lines = (tmp_path / "said-out.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "said-out.jsonl").write_text("".join(lines[:4]))  # 3 requests left: more than the 2 rows
    (resumed,) = _said_before(ckpt, tmp_path, offload_dir, capsys, "--resume")
    assert "3 requests run on 2 rows" in resumed


def test_api_no_refill_is_the_cli_flag(ckpt, offload_dir, monkeypatch):
    seen = []
    real = batch_run.run_requests

    def spy(*args, **kw):
        seen.append(kw["refill"])
        return real(*args, **kw)
    monkeypatch.setattr(batch_run, "run_requests", spy)
    common = {"gpu_batch_size": 2, "offload_dir": offload_dir, "no_warmup": True, "verbose": 0}
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(ckpt, **common) as llm:
        want = [o.record() for o in llm.generate(_prompts(), params)]
    with LLM(ckpt, no_refill=True, **common) as llm:
        assert llm.args.no_refill is True
        got = [o.record() for o in llm.generate(_prompts(), params)]
    assert seen == [True, False] and got == want


def test_no_refill_outside_a_request_job_is_refused_in_one_line(capsys):
    """A fixed-length run has no refill to turn off: the flag is refused, not ignored."""
    assert cli.main(["--model", "opt-125m", "--no-refill", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--no-refill applies to request jobs" in err


def test_ignore_eos_outside_a_request_job_is_refused_in_one_line(capsys):
    """A fixed-length run never stops at EOS: --ignore-eos there is refused, not ignored."""
    assert cli.main(["--model", "opt-125m", "--ignore-eos", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--ignore-eos applies to request jobs" in err


def test_api_ignore_eos_of_the_llm_holds_unless_the_params_say(ckpt, offload_dir, monkeypatch):
    """LLM(ignore_eos=True) is not undone by SamplingParams' default; SamplingParams(ignore_eos=False) undoes it."""
    seen = []
    real = batch_run.run_requests

    def spy(rc, reqs, rule, **kw):
        seen.append(rule.eos_ids)
        return real(rc, reqs, rule, **kw)
    monkeypatch.setattr(batch_run, "run_requests", spy)
    common = {"gpu_batch_size": 2, "offload_dir": offload_dir, "no_warmup": True, "verbose": 0, "eos_id": [5]}
    with LLM(ckpt, ignore_eos=True, **common) as llm:
        llm.generate(_prompts()[:2], SamplingParams(max_tokens=3))
        llm.generate(_prompts()[:2], SamplingParams(max_tokens=3, ignore_eos=False))
    assert seen == [frozenset(), frozenset({5})]


def test_eos_id_outside_a_request_job_is_refused_in_one_line(capsys):
    """A fixed-length run never stops at EOS: --eos-id there would change nothing, so it is refused, not ignored."""
    assert cli.main(["--model", "opt-125m", "--eos-id", "2", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--eos-id applies to request jobs" in err, err
