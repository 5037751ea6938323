"""The dtype decision (planning/dtype_choice.py): follows the probe's timings, explicit flags win, the probe is
cached per machine, disk-homed data stays 16-bit; the CLI records what ran and why."""
from __future__ import annotations

import json
import os

import pytest
import torch

from flexh2o.cli import run as cli
from flexh2o.config import from_name
from flexh2o.placement import Percent
from flexh2o.planning import dtype_choice, machine
from flexh2o.run_config import RunConfig

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def timings(fast: str, slow: float = 5.0) -> dict:
    """Fake probe timings where `fast` computes `slow` times faster than the others; conversions cost little."""
    names = ("float32", "bfloat16", "float16")
    speed = {n: 1.0 if n == fast else slow for n in names}
    return {"decode": {n: 0.01 * speed[n] for n in names}, "prefill": {n: 0.01 * speed[n] for n in names},
            "convert": {f"{a}->{b}": 0.001 for a in names for b in names if a != b}}


def rc_for(percent=(0, 100, 100, 0), **kw) -> RunConfig:
    caps = {"gpu_mem": 8 << 30, "cpu_mem": 8 << 30, "disk_mem": 8 << 30, **kw}
    return RunConfig(model=from_name("opt-125m"), percent=Percent(*percent), gpu_batch_size=4, prompt_len=64,
                     gen_len=16, **caps)


@pytest.mark.parametrize("fast,want", [("float32", F32), ("bfloat16", BF16), ("float16", F16)])
def test_choice_follows_the_probe(fast, want):
    got = dtype_choice.choose_dtypes(rc_for(), "auto", "auto", probe=lambda: (timings(fast), True))
    assert (got.dtype, got.compute) == (want, want)  # memory-resident and it fits: stored as computed
    assert f"compute {fast} (auto" in got.reason and got.note is None


def test_explicit_compute_dtype_wins_and_a_much_slower_pair_gets_a_note():
    got = dtype_choice.choose_dtypes(rc_for(), "bfloat16", "bfloat16", probe=lambda: (timings("float32"), True))
    assert (got.dtype, got.compute) == (BF16, BF16)
    assert got.note and "--dtype float32 --compute-dtype float32" in got.note
    got = dtype_choice.choose_dtypes(rc_for(), "auto", "float16", probe=lambda: (timings("float32"), True))
    assert got.compute == F16 and got.dtype == F16 and "explicit" in got.reason


def test_explicit_storage_keeps_its_dtype_and_picks_the_fastest_compute():
    got = dtype_choice.choose_dtypes(rc_for(), "bfloat16", "auto", probe=lambda: (timings("float32"), True))
    assert (got.dtype, got.compute) == (BF16, F32) and got.note is None


def test_disk_homed_weights_stay_16_bit():
    got = dtype_choice.choose_dtypes(rc_for((0, 0, 100, 0)), "auto", "auto", probe=lambda: (timings("float32"), True))
    assert got.compute == F32 and got.dtype in (BF16, F16) and "disk" in got.reason


def test_compressed_weights_on_disk_are_stored_as_computed_where_nothing_plain_is_read_from_disk():
    """16 bits would shrink only a 4-bit weight's scales; the plain cache on disk is still halved by them."""
    from flexh2o.compress import CompressionSpec
    from flexh2o.kv.layout import CacheQuant
    probe = lambda: (timings("float32"), True)  # noqa: E731
    w4 = rc_for((0, 0, 100, 0)).with_(compress_weight=CompressionSpec(4, 64, 1))
    got = dtype_choice.choose_dtypes(w4, "auto", "auto", probe=probe)
    assert (got.dtype, got.compute) == (F32, F32) and "only compressed weights or cache on disk" in got.reason
    plain_cache = rc_for((0, 0, 0, 0)).with_(compress_weight=CompressionSpec(4, 64, 1))  # the cache on disk too
    got = dtype_choice.choose_dtypes(plain_cache, "auto", "auto", probe=probe)
    assert got.dtype in (BF16, F16) and "16 bits halve the bytes read" in got.reason
    both = plain_cache.with_(compress_cache=CacheQuant.of(CompressionSpec(4, 64, -1)))
    got = dtype_choice.choose_dtypes(both, "auto", "auto", probe=probe)
    assert got.dtype == F32
    tight = w4.with_(gpu_mem=1 << 20, cpu_mem=1 << 20)  # fp32 stored would not fit: 16 bits as before
    got = dtype_choice.choose_dtypes(tight, "auto", "auto", probe=probe)
    assert got.dtype in (BF16, F16)


def test_storage_falls_back_to_16_bit_when_the_wide_dtype_does_not_fit():
    rc = rc_for(cpu_mem=300 << 20)  # opt-125m: 239 MiB in 16 bits, 478 MiB in float32
    got = dtype_choice.choose_dtypes(rc, "auto", "auto", probe=lambda: (timings("float32", slow=1.5), True))
    assert got.dtype in (BF16, F16) and "overflow" in got.reason


def test_probe_is_cached_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXH2O_CACHE_DIR", str(tmp_path))
    calls = []

    def measure():
        calls.append(1)
        return timings("bfloat16")
    first, cached1 = dtype_choice.cached_probe(measure)
    second, cached2 = dtype_choice.cached_probe(measure)
    assert calls == [1] and (cached1, cached2) == (False, True) and first == second
    files = list(tmp_path.glob("dtype_probe-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["fingerprint"] == machine.fingerprint("cpu")


def test_probe_taken_on_a_busy_machine_is_taken_again_once_quiet(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXH2O_CACHE_DIR", str(tmp_path))
    calls = []

    def measure():
        calls.append(1)
        return timings("bfloat16")
    cores = os.cpu_count()
    monkeypatch.setattr(machine, "load_now", lambda: 6.0 * cores)
    dtype_choice.cached_probe(measure)
    dtype_choice.cached_probe(measure)
    assert calls == [1]  # busy then and now: reused
    monkeypatch.setattr(machine, "load_now", lambda: 0.2)
    _, cached = dtype_choice.cached_probe(measure)
    assert calls == [1, 1] and not cached
    dtype_choice.cached_probe(measure)
    assert calls == [1, 1]  # the quiet one is kept


def test_real_probe_measures_every_candidate():
    t = dtype_choice.probe_timings()
    assert set(t["decode"]) == set(t["prefill"]) == {"float32", "bfloat16", "float16"}
    assert all(v > 0 for v in t["decode"].values()) and "bfloat16->float32" in t["convert"]


def test_cli_records_the_choice_and_its_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(dtype_choice, "cached_probe", lambda: (timings("bfloat16"), True))
    log = tmp_path / "log.jsonl"
    argv = ["--model", "opt-125m", "--percent", "0", "100", "100", "0", "--gpu-batch-size", "2", "--prompt-len", "8",
            "--gen-len", "2", "--no-warmup", "--log-file", str(log)]
    assert cli.main(argv) == 0
    rec = json.loads(log.read_text())
    assert rec["policy"]["dtype"] == rec["policy"]["compute_dtype"] == "bfloat16"
    assert "compute bfloat16 (auto" in rec["dtype_reason"] and "compute bfloat16" in capsys.readouterr().out
    assert cli.main(argv + ["--dtype", "float16", "--compute-dtype", "float16"]) == 0
    assert "note: --dtype float16 --compute-dtype float16 is about" in capsys.readouterr().err
