"""The results file of a request job survives kill -9: a torn last line is dropped, --resume skips the answered
ids, and the union of the interrupted runs equals one uninterrupted greedy run, token for token."""
from __future__ import annotations

import random
import sys

import pytest

from flexh2o.batch.results import done_ids
from flexh2o.cli import run as cli
from request_helpers import kill_9_until_done, read_jsonl, write_jsonl
from tiny_models import write_tiny_checkpoint


def test_torn_last_line_is_dropped(tmp_path):
    out = tmp_path / "o.jsonl"
    good = '{"id": "a", "token_ids": [1]}\n{"id": "b", "token_ids": [2]}\n'
    out.write_text(good + '{"id": "c", "tok')
    assert done_ids(str(out)) == {"a", "b"}
    assert out.read_text() == good  # cut back to the last complete line
    assert done_ids(str(out)) == {"a", "b"}


def test_corrupt_middle_line_is_refused(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(ValueError, match="line 2"):
        done_ids(str(out))


def _requests(n: int) -> list:
    rng = random.Random(4)
    return [{"id": f"q{i}", "prompt_ids": [rng.randrange(4, 512) for _ in range(rng.randint(2, 12))],
             "max_new_tokens": rng.randint(8, 40)} for i in range(n)]


@pytest.mark.slow
def test_kill_9_then_resume_equals_uninterrupted(tmp_path, offload_dir):
    ckpt = write_tiny_checkpoint(str(tmp_path / "ckpt"))
    reqs = write_jsonl(tmp_path / "r.jsonl", _requests(40))
    base = ["--path", ckpt, "--prompt-file", reqs, "--gpu-batch-size", "2", "--offload-dir", offload_dir,
            "--no-warmup", "--verbose", "0", "--eos-id", "21"]
    whole = tmp_path / "whole.jsonl"
    assert cli.main(base + ["--output-file", str(whole)]) == 0
    want = {r["id"]: r for r in read_jsonl(whole)}
    assert len(want) == 40
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "flexh2o.cli"] + base + ["--output-file", str(out), "--resume"]
    kills = kill_9_until_done(argv, out, random.Random(11))
    got = read_jsonl(out)
    assert kills >= 2 and len(got) == 40 and len({r["id"] for r in got}) == 40  # every id once
    assert {r["id"]: r for r in got} == want
