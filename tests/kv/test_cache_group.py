"""--cache-group-size: the cached values' groups along head_dim apart from the weights' --compress-group-size (their
own default, compress/defaults.py); the plan's bytes count them and the printed command line reads back to the same
cache."""
from __future__ import annotations

import pytest
import torch

from flexh2o.cli import run as run_cli
from flexh2o.cli.compress_flags import compression_specs
from flexh2o.compress.defaults import DEFAULT_CACHE_GROUP, DEFAULT_GROUP, DEFAULT_RECENT
from flexh2o.kv.layout import CacheLayout


def _specs(*flags):
    return compression_specs(run_cli.build_parser().parse_args(["--model", "opt-125m", *flags]))


def test_cache_group_has_its_own_default_and_follows_an_explicit_compress_group():
    _, cache = _specs("--compress-cache")
    assert (cache.group_size, cache.recent) == (DEFAULT_CACHE_GROUP, DEFAULT_RECENT)
    weights, cache = _specs("--compress-weight", "--compress-cache")
    assert (weights.group_size, cache.group_size) == (DEFAULT_GROUP, DEFAULT_CACHE_GROUP)
    _, cache = _specs("--compress-cache", "--compress-group-size", "16")
    assert cache.group_size == 16  # given: FlexGen's meaning, one group size for both
    weights, cache = _specs("--compress-weight", "--compress-cache", "--cache-group-size", "16")
    assert (weights.group_size, cache.group_size) == (DEFAULT_GROUP, 16)
    _, cache = _specs("--compress-cache", "--compress-group-size", "16", "--cache-group-size", "64")
    assert cache.group_size == 64


def test_flexgen_per_token_keys_keep_flexgen_groups():
    """FlexGen's scheme (keys and values per token) keeps FlexGen's group of 64 unless a group is given."""
    _, cache = _specs("--compress-cache", "--cache-keys", "token", "--key-outliers", "0", "--cache-recent", "0",
                      "--cache-sinks", "0", "--no-cache-rotate")
    assert (cache.keys, cache.group_size, cache.recent, cache.sinks, cache.rotate) == ("token", DEFAULT_GROUP, 0, 0,
                                                                                       False)
    _, cache = _specs("--compress-cache", "--cache-keys", "token", "--cache-group-size", "32")
    assert cache.group_size == 32


def test_smaller_value_groups_cost_their_metadata_in_the_layout():
    _, g64 = _specs("--compress-cache", "--cache-group-size", "64")
    _, g32 = _specs("--compress-cache", "--cache-group-size", "32")
    a, b = (CacheLayout(1, 1, 10, 64, torch.float16, q).kv_slot_bytes() for q in (g64, g32))
    assert b - a == 4  # one more fp16 scale and minimum a token and KV head


@pytest.mark.parametrize("flags", [["--compress-weight", "--compress-cache", "--cache-group-size", "16"],
                                   ["--compress-cache"], ["--compress-cache", "--cache-group-size", "64"],
                                   ["--compress-weight", "--compress-cache", "--compress-group-size", "16"],
                                   ["--compress-weight", "--compress-cache", "--compress-group-size", "16",
                                    "--cache-group-size", "32"],
                                   ["--compress-cache", "--cache-keys", "token"],
                                   ["--compress-cache", "--cache-keys", "token", "--cache-group-size", "32"]])
def test_command_line_carries_the_cache_group(flags):
    from flexh2o.config import from_name
    from flexh2o.tuning.search import command_line
    rc = run_cli.build_run_config(run_cli.build_parser().parse_args(["--model", "opt-125m", *flags]),
                                  from_name("opt-125m"), None)
    line = command_line(rc).split()
    if "--cache-group-size" in flags:
        assert "--cache-group-size" in line and line[line.index("--cache-group-size") + 1] == flags[-1]
    back = run_cli.build_run_config(run_cli.build_parser().parse_args(line[1:]), rc.model, None)
    assert (back.compress_weight, back.compress_cache) == (rc.compress_weight, rc.compress_cache)


def test_a_bad_cache_group_is_refused_naming_its_flag(capsys):
    assert run_cli.main(["--model", "opt-125m", "--compress-cache", "--cache-group-size", "1", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--cache-group-size 1" in err and "--compress-group-size" not in err


def test_a_cache_flag_without_the_quantized_cache_is_refused(capsys):
    """--cache-keys, --key-outliers, --cache-recent, --cache-sinks, --cache-group-size and --cache-rotate set the
    quantized cache: given without --compress-cache they would change nothing, so the run is refused in one line."""
    for flags in (["--cache-keys", "fitted"], ["--key-outliers", "2"], ["--cache-recent", "0"], ["--cache-sinks", "0"],
                  ["--cache-group-size", "32"], ["--no-cache-rotate"]):
        assert run_cli.main(["--model", "opt-125m", *flags, "--dry-run"]) == 2, flags
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and flags[0] in err and "--compress-cache" in err, err
    assert run_cli.main(["--model", "opt-125m", "--cache-keys", "channel", "--dry-run"]) == 0  # its default: no-op


def test_the_rotation_is_the_default_and_the_command_line_carries_its_absence():
    from flexh2o.config import from_name
    from flexh2o.tuning.search import command_line
    parse = run_cli.build_parser().parse_args
    argv = ["--model", "opt-125m", "--compress-cache", "--compress-bits", "3"]
    rc = run_cli.build_run_config(parse(argv), from_name("opt-125m"), None)
    assert rc.compress_cache.rotate and "rotated" in rc.compress_cache.describe()  # --cache-rotate's default
    off = run_cli.build_run_config(parse(argv + ["--no-cache-rotate"]), rc.model, None)
    assert not off.compress_cache.rotate
    for cfg, flag in ((rc, None), (off, "--no-cache-rotate")):
        line = command_line(cfg).split()
        assert (flag in line) if flag else not any("rotate" in x for x in line)
        back = run_cli.build_run_config(parse(line[1:]), rc.model, None)
        assert back.compress_cache == cfg.compress_cache


def test_quantization_flags_that_would_change_nothing_are_refused(capsys):
    """--compress-bits or --compress-group-size with neither --compress-weight nor --compress-cache, and
    --key-outliers with keys per token (which keep no value exact), would be ignored: one line, exit 2. FlexGen's
    scheme written out (--cache-keys token --key-outliers 0) and the flags at their defaults stay accepted."""
    for flags, needle in ((["--compress-bits", "3"], "--compress-bits 3"),
                          (["--compress-group-size", "32"], "--compress-group-size 32"),
                          (["--compress-cache", "--cache-keys", "token", "--key-outliers", "4"], "--key-outliers 4")):
        assert run_cli.main(["--model", "opt-125m", *flags, "--dry-run"]) == 2, flags
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
    for flags in (["--compress-bits", "4"], ["--compress-cache", "--cache-keys", "token", "--key-outliers", "0"],
                  ["--compress-weight", "--compress-group-size", "32"], ["--compress-cache", "--compress-bits", "3"]):
        assert run_cli.main(["--model", "opt-125m", *flags, "--dry-run"]) == 0, flags
    capsys.readouterr()
    _, flexgen = _specs("--compress-cache", "--cache-keys", "token", "--key-outliers", "0")
    assert flexgen.keys == "token" and flexgen.outliers == 0


def test_the_plan_counts_the_default_scheme_bytes():
    """The plan's cache block under --compress-cache is the default's layout: against groups of 64 with the newest
    16 tokens exact, per row and KV head each slot holds d/G - d/64 more fp16 scale + minimum pairs (4 bytes each)
    and the ring DEFAULT_RECENT - 16 more entries, each K and V in fp16 plus their int32 ring slots (2 x d x 2 + 2 x 4
    bytes): exact byte arithmetic, no tolerance."""
    import dataclasses

    from flexh2o.config import from_name
    from flexh2o.planning.memory_plan import cache_block_bytes
    argv = ["--model", "opt-125m", "--compress-cache", "--gpu-batch-size", "2", "--dtype", "float16"]
    rc = run_cli.build_run_config(run_cli.build_parser().parse_args(argv), from_name("opt-125m"), None)
    old = rc.with_(compress_cache=dataclasses.replace(rc.compress_cache, group_size=64, recent=16))
    lay = CacheLayout.of_run(rc)
    d = lay.head_dim
    per = lay.slots * 4 * (d // DEFAULT_CACHE_GROUP - d // 64) + (DEFAULT_RECENT - 16) * (2 * d * 2 + 2 * 4)
    assert cache_block_bytes(rc) - cache_block_bytes(old) == lay.batch * lay.heads * per
