"""`flexh2o-eval recall` and `ppl` run every KV policy (the new ones with their flags) end to end on a tiny seeded
model with a byte-level tokenizer built here: one result row per (policy, budget, task). Accuracy on a random model
means nothing; that every lane runs and is reported is what is checked."""
from __future__ import annotations

import json

import pytest

from flexh2o.cli import eval as eval_cli
from flexh2o.eval.common import EVICTING
from tiny_models import tiny_opt, write_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model folder, tokenizer.json): a 2-layer OPT and a 256-token byte-level vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    root = tmp_path_factory.mktemp("tiny")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(root / "tokenizer.json"))
    write_tiny_checkpoint(str(root / "model"), tiny_opt(vocab=512, max_positions=512))
    return str(root / "model"), str(root / "tokenizer.json")


@pytest.mark.parametrize("task, extra, keys", [
    ("recall", ["--samples", "1", "--context", "160"], ("passkey", "kv")),
    ("ppl", ["--windows", "1", "--context", "96", "--prefix", "8", "--texts", "hamlet"], ("hamlet",)),
])
def test_every_policy_runs(task, extra, keys, tiny, tmp_path, capsys):
    model, tokenizer = tiny
    out = tmp_path / "r.json"
    argv = [task, "--model", model, "--tokenizer", tokenizer, "--dtype", "float32", "--budgets", "24",
            "--policies", ",".join(EVICTING), "--pyramid-ratio", "0.25", "--head-cap", "1.5", "--no-progress",
            "--out", str(out)] + extra
    assert eval_cli.main(argv) == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())["rows"]
    field = "task" if task == "recall" else "text"
    for key in keys:
        got = {r["policy"] for r in rows if r.get(field) == key and r.get("budget_tokens") == 24}
        assert got == set(EVICTING), (key, sorted(got))


def test_the_record_holds_the_cache_group_it_ran_with(tiny, tmp_path, capsys):
    """--compress-cache without --cache-group-size: the record's cache_group_size is the group the cache ran with
    (compress/defaults.cache_group), not the flag's None."""
    from flexh2o.compress.defaults import DEFAULT_CACHE_GROUP, DEFAULT_RECENT
    model, tokenizer = tiny
    for extra, group in (([], DEFAULT_CACHE_GROUP), (["--compress-group-size", "16"], 16)):
        out = tmp_path / f"r{group}.json"
        argv = ["ppl", "--model", model, "--tokenizer", tokenizer, "--dtype", "float32", "--policies", "h2o",
                "--budgets", "100%", "--windows", "1", "--context", "96", "--prefix", "8", "--texts", "hamlet",
                "--no-progress", "--compress-cache", "--out", str(out)] + extra
        assert eval_cli.main(argv) == 0, capsys.readouterr().err
        record = json.loads(out.read_text())
        assert (record["cache_group_size"], record["cache_recent"]) == (group, DEFAULT_RECENT), record
        # the tables' header names the full run's cache as it ran: quantized, not the exact cache
        heads = [line for line in capsys.readouterr().out.splitlines() if line.startswith("hamlet: ")]
        assert len(heads) == 2 and all(f", full cache, quantized 4-bit/{group} (" in h for h in heads), heads


def test_the_tables_name_an_exact_full_cache_plainly(tiny, tmp_path, capsys):
    """Without --compress-cache the header's reference is the plain full cache."""
    model, tokenizer = tiny
    argv = ["ppl", "--model", model, "--tokenizer", tokenizer, "--dtype", "float32", "--policies", "h2o",
            "--budgets", "50%", "--windows", "1", "--context", "96", "--prefix", "8", "--texts", "hamlet",
            "--no-progress"]
    assert eval_cli.main(argv) == 0, capsys.readouterr().err
    heads = [line for line in capsys.readouterr().out.splitlines() if line.startswith("hamlet: ")]
    assert len(heads) == 2 and all(", full cache " in h and "quantized" not in h for h in heads), heads
