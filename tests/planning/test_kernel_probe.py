"""The engine's int4-or-expanded probe (planning/kernel_probe.py) is measured once per machine and case, so every
run of one plan takes one path; and the rule (compress/choice.kernel_phases) takes the generic path only where it is
faster by more than its margin."""
from __future__ import annotations

import json
import os

import torch

from flexh2o.compress.choice import KERNEL_MARGIN, PHASES, kernel_phases
from flexh2o.compress.codec import CompressionSpec
from flexh2o.planning import kernel_probe, machine

SPEC = CompressionSpec(4, 64, 1)
F32 = dict.fromkeys(PHASES, torch.float32)


def _measure(calls, int4=1.0, generic=2.0):
    def measure(shape, rows, spec, dtypes):
        calls.append((shape, dict(rows)))
        return {p: {"int4": int4, "generic": generic} for p in PHASES}
    return measure


def test_each_case_is_measured_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXH2O_CACHE_DIR", str(tmp_path))
    calls = []
    rows = {"prefill": 256, "decode": 4}
    first = kernel_probe.cached_timer((64, 128), rows, SPEC, F32, _measure(calls))
    again = kernel_probe.cached_timer((64, 128), rows, SPEC, F32, _measure(calls, int4=9.0))
    assert first == again and len(calls) == 1  # the second run reads the first one's measurement
    other = kernel_probe.cached_timer((64, 128), {"prefill": 512, "decode": 4}, SPEC, F32, _measure(calls, int4=9.0))
    assert other["prefill"]["int4"] == 9.0 and len(calls) == 2  # another batch: its own case
    bf16 = dict(F32, decode=torch.bfloat16)
    kernel_probe.cached_timer((64, 128), rows, SPEC, bf16, _measure(calls))
    kernel_probe.cached_timer((64, 128), rows, CompressionSpec(4, 32, 1), F32, _measure(calls))
    assert len(calls) == 4  # dtypes and spec are part of the case
    files = list(tmp_path.glob("kernel_probe-*.json"))
    assert len(files) == 1  # one file per machine, every case in it
    data = json.loads(files[0].read_text())
    assert data["fingerprint"] == machine.fingerprint("cpu") and len(data["cases"]) == 4


def test_a_case_measured_on_a_busy_machine_is_measured_again_once_quiet(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXH2O_CACHE_DIR", str(tmp_path))
    calls, rows = [], {"prefill": 64, "decode": 2}
    cores = os.cpu_count()
    monkeypatch.setattr(machine, "load_now", lambda: 6.0 * cores)
    kernel_probe.cached_timer((64, 128), rows, SPEC, F32, _measure(calls))
    kernel_probe.cached_timer((64, 128), rows, SPEC, F32, _measure(calls))
    assert len(calls) == 1
    monkeypatch.setattr(machine, "load_now", lambda: 0.2)
    kernel_probe.cached_timer((64, 128), rows, SPEC, F32, _measure(calls))
    kernel_probe.cached_timer((64, 128), rows, SPEC, F32, _measure(calls))
    assert len(calls) == 2  # taken again once, then kept


def test_an_unreadable_cache_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXH2O_CACHE_DIR", str(tmp_path))
    name = f"kernel_probe-v{kernel_probe.PROBE_VERSION}-{machine.fingerprint_key(machine.fingerprint('cpu'))}.json"
    (tmp_path / name).write_text("{not json")
    calls = []
    got = kernel_probe.cached_timer((64, 128), {"prefill": 64, "decode": 2}, SPEC, F32, _measure(calls))
    assert len(calls) == 1 and got["decode"] == {"int4": 1.0, "generic": 2.0}
    assert json.loads((tmp_path / name).read_text())["version"] == kernel_probe.PROBE_VERSION


def test_the_generic_path_needs_to_be_faster_by_the_margin():
    def timer(ratio):  # the kernel takes `ratio` times the generic path's time at both phases
        return lambda shape, rows, spec, dtypes: {p: {"int4": ratio, "generic": 1.0} for p in PHASES}
    rows = {"prefill": 64, "decode": 2}
    within = kernel_phases("auto", (64, 128), rows, SPEC, F32, timer=timer(KERNEL_MARGIN * 0.99))
    beyond = kernel_phases("auto", (64, 128), rows, SPEC, F32, timer=timer(KERNEL_MARGIN * 1.01))
    assert within == dict.fromkeys(PHASES, True) and beyond == dict.fromkeys(PHASES, False)
    # expanding that does not fit still runs the kernel, however much faster expanding is
    assert kernel_phases("auto", (64, 128), rows, SPEC, F32, lambda k: k["prefill"], timer(10.0))["prefill"]
