"""--hardware auto: this machine's profile is cached per fingerprint and measured once; a profile of another
machine warns in one line. The measurement itself is monkeypatched (it takes up to a minute)."""
from __future__ import annotations

import json
import os

from flexh2o.cli import run as cli
from flexh2o.planning import machine
from flexh2o.tuning import profile_cache
from flexh2o.tuning.hardware import load_profile


def fake_measure(calls: list):
    def measure(device, dtypes, offload_dir, quick, progress=lambda n: None):
        calls.append(tuple(dtypes))
        progress(1)
        return {**load_profile("cpu_measured"), "fingerprint": machine.fingerprint(device)}
    return measure


def first_measure() -> list:
    """The calls a first profile of a float32 run makes: float32, and bfloat16 too on a CPU with bf16 units."""
    return [tuple(profile_cache.wanted_dtypes("cpu", "float32"))]


def test_cached_profile_is_reused_without_measuring_again(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXH2O_CACHE_DIR", str(tmp_path))
    calls = []
    assert profile_cache.auto_profile("cpu", "float32", None, may_measure=False, measure=fake_measure(calls)) is None
    first = profile_cache.auto_profile("cpu", "float32", None, may_measure=True, measure=fake_measure(calls))
    again = profile_cache.auto_profile("cpu", "float32", None, may_measure=True, measure=fake_measure(calls))
    assert calls == first_measure() and first["fingerprint"] == again["fingerprint"] == machine.fingerprint("cpu")
    assert os.path.exists(tmp_path / profile_cache.profile_file("cpu"))
    assert "float16" not in profile_cache.auto_profile("cpu", "float16", None, may_measure=False)["matmul_flops"]
    assert len(calls) == 1  # without may_measure a dtype the cached profile lacks is not measured


def test_a_dtype_the_cached_profile_lacks_is_added_once_when_planning(tmp_path, monkeypatch, capsys):
    """--dry-run / --policy auto of a run whose decode computes in another dtype: only that dtype is measured, merged
    into the cached profile, and not measured again."""
    monkeypatch.setenv("FLEXH2O_CACHE_DIR", str(tmp_path))
    calls, added = [], []

    def fake_add(prof, dtypes, progress=lambda n: None):
        added.append(tuple(dtypes))
        return {**prof, "matmul_flops": {**prof["matmul_flops"], **{d: 1e9 for d in dtypes}}}
    profile_cache.auto_profile("cpu", ["float32"], None, may_measure=True, measure=fake_measure(calls))
    got = profile_cache.auto_profile("cpu", ["float32", "float16"], None, may_measure=True, add=fake_add)
    again = profile_cache.auto_profile("cpu", ["float32", "float16"], None, may_measure=True, add=fake_add)
    assert calls == first_measure() and added == [("float16",)]
    assert got["matmul_flops"]["float16"] == again["matmul_flops"]["float16"] == 1e9
    assert "profiling float16 on this machine" in capsys.readouterr().err


def test_add_dtypes_merges_measured_rates_into_the_profile(monkeypatch):
    from flexh2o.tuning import measure
    monkeypatch.setattr(measure, "compute_rates", lambda dtype, dev, quick: {
        "matmul_flops": 2e9, "decode_matmul_flops": 1e9, "attention_flops": 1e9, "decode_attention_flops": 1e9})
    monkeypatch.setattr(measure, "matmul_rows_rates", lambda dtype, dev, quick: {"4": 1e9})
    prof = {**load_profile("cpu_measured"), "device": "cpu", "quick": True}
    before = dict(prof["matmul_flops"])
    out = measure.add_dtypes(prof, ["float16"])
    assert out["matmul_flops"]["float16"] == 2e9 and out["decode_matmul_flops"]["float16"] == 1e9
    assert out["matmul_flops_by_rows"]["float16"] == {"4": 1e9}
    assert prof["matmul_flops"] == before  # the input is not changed
    assert {k: v for k, v in out["matmul_flops"].items() if k != "float16"} == before


def test_cli_dry_run_measures_once_then_uses_the_cache(tmp_path, monkeypatch, capsys):
    from flexh2o.tuning import measure
    monkeypatch.setenv("FLEXH2O_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(measure, "measure", fake_measure(calls))
    argv = ["--model", "opt-125m", "--prompt-len", "8", "--gen-len", "2", "--dtype", "float32", "--compute-dtype",
            "float32", "--dry-run"]
    assert cli.main(argv) == 0 and cli.main(argv) == 0
    out = capsys.readouterr()
    assert len(calls) == 1 and "profiling this machine" in out.err
    assert out.out.count("predicted (cost model, profile of this machine (auto))") == 2


def test_profile_of_another_machine_warns_in_one_line(tmp_path, capsys):
    other = {**machine.fingerprint("cpu"), "cpu_model": "Other CPU", "cpu_flags": ["avx512_bf16", "avx512f"]}
    prof = {**load_profile("cpu_measured"), "fingerprint": other}
    path = tmp_path / "other.json"
    path.write_text(json.dumps(prof))
    line = profile_cache.mismatch_warning(prof, "cpu", str(path))
    assert line and "cpu_model, cpu_flags" in line and "\n" not in line
    assert profile_cache.mismatch_warning({**prof, "fingerprint": machine.fingerprint("cpu")}, "cpu", "x") is None
    assert cli.main(["--model", "opt-125m", "--prompt-len", "8", "--gen-len", "2", "--dtype", "float32",
                     "--compute-dtype", "float32", "--hardware", str(path), "--dry-run"]) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if "warning: hardware profile" in ln]
    assert len(err) == 1 and "measured on another machine" in err[0]


def test_shipped_gpu_profiles_stay_for_planning_other_hardware():
    for name in ("t4_paper", "a100_80gb"):
        assert load_profile(name)["matmul_flops"]


def test_stale_by_load_only_for_busy_measurements_on_a_now_quieter_machine():
    assert machine.stale_by_load(9.0, now=1.0, cores=2)  # busy then, quiet now
    assert not machine.stale_by_load(9.0, now=6.0, cores=2)  # still busy
    assert not machine.stale_by_load(1.5, now=0.1, cores=2)  # it was not busy
    assert not machine.stale_by_load(None, now=0.0, cores=2)  # older files carry no load


def test_load_seen_is_the_load_a_crowded_out_measurement_implies():
    """A measurement that got a quarter of its two threads' CPU time ran as if 8 runnable threads shared the cores
    (2 / 0.25), whatever the lagging load average said; one that got its CPU keeps the load average."""
    def clocks(wall, cpu):  # each clock read once at the start (0) and once at the end
        return iter([0.0, wall]).__next__, iter([0.0, cpu]).__next__

    with machine.LoadSeen(2, clocks(1.0, 0.5), load=lambda: 0.5) as crowded:
        pass
    assert crowded.load == 2 / 0.25
    with machine.LoadSeen(2, clocks(1.0, 1.9), load=lambda: 0.5) as alone:
        pass
    assert alone.load == 0.5
    assert machine.stale_by_load(crowded.load, now=0.5, cores=2) and not machine.stale_by_load(alone.load, 0.5, 2)


def test_profile_measured_on_a_busy_machine_is_measured_again_once_quiet(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLEXH2O_CACHE_DIR", str(tmp_path))
    calls = []
    cores = os.cpu_count()
    busy = {**load_profile("cpu_measured"), "fingerprint": machine.fingerprint("cpu"), "load_at_measure": 5.0 * cores}
    machine.write_cached(profile_cache.profile_file("cpu"), busy)
    monkeypatch.setattr(machine, "load_now", lambda: 4.0 * cores)  # still busy: the cached one is kept
    kept = profile_cache.auto_profile("cpu", "float32", None, may_measure=True, measure=fake_measure(calls))
    assert calls == [] and kept["load_at_measure"] == 5.0 * cores
    monkeypatch.setattr(machine, "load_now", lambda: 0.1)
    again = profile_cache.auto_profile("cpu", "float32", None, may_measure=True, measure=fake_measure(calls))
    assert calls == first_measure() and again.get("load_at_measure") != 5.0 * cores
    assert "measured at load" in capsys.readouterr().err
    assert machine.read_cached(profile_cache.profile_file("cpu")).get("load_at_measure") != 5.0 * cores


def test_a_dtype_added_on_a_busy_machine_is_measured_again_when_quiet(tmp_path, monkeypatch, capsys):
    """add_dtypes records the load of what it measured; when the machine is now much quieter (machine.stale_by_load)
    that dtype alone is measured again, once."""
    monkeypatch.setenv("FLEXH2O_CACHE_DIR", str(tmp_path))
    calls, added = [], []
    load = {"now": 9.0}
    monkeypatch.setattr(machine, "load_now", lambda: load["now"])

    def fake_add(prof, dtypes, progress=lambda n: None):
        added.append(tuple(dtypes))
        return {**prof, "matmul_flops": {**prof["matmul_flops"], **{d: load["now"] for d in dtypes}},
                "dtype_load_at_measure": {**prof.get("dtype_load_at_measure", {}), **{d: load["now"] for d in dtypes}}}
    monkeypatch.setattr(machine, "stale_by_load",
                        lambda at, now=None, cores=None: at is not None and at > 2 > load["now"])
    profile_cache.auto_profile("cpu", ["float32"], None, may_measure=True, measure=fake_measure(calls))
    busy = profile_cache.auto_profile("cpu", ["float32", "float16"], None, may_measure=True, add=fake_add)
    load["now"] = 0.5
    quiet = profile_cache.auto_profile("cpu", ["float32", "float16"], None, may_measure=True, add=fake_add)
    again = profile_cache.auto_profile("cpu", ["float32", "float16"], None, may_measure=True, add=fake_add)
    assert added == [("float16",), ("float16",)] and len(calls) == 1
    assert busy["matmul_flops"]["float16"] == 9.0
    assert quiet["matmul_flops"]["float16"] == again["matmul_flops"]["float16"] == 0.5
    assert "float16 rates of this machine were measured at load 9.0 (now 0.5)" in capsys.readouterr().err


def test_cpu_record_reads_the_first_processor_of_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    first = "processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f f16c\n"
    info.write_text(first + "\nprocessor\t: 1\ncpu family\t: 6\nmodel\t\t: 85\nmodel name\t: Other\nflags\t\t: amx_tile\n")
    assert machine.cpu_record(str(info)) == {"cpu_model": "AMD EPYC", "cpu_family": "25", "cpu_model_number": "17",
                                            "cpu_flags": ["avx2", "avx512f", "f16c"]}
    missing = machine.cpu_record(str(tmp_path / "absent"))
    assert missing["cpu_family"] is None and missing["cpu_flags"] == [] and missing["cpu_model"]
