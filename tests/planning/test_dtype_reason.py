"""The summary's dtype line never reads 'float16 inf': the probe times conversions to and from float32 only, so an
automatic choice never lists (or picks) a cast from one 16-bit dtype into the other (the README's SmolLM2 example,
`--dtype bfloat16`, printed 'relative linear time float32 1.00, bfloat16 ..., float16 inf')."""
from __future__ import annotations

import math
import re

import pytest
import torch

from conftest import FIXTURE_PROBE
from flexh2o.config import from_name
from flexh2o.placement import Percent
from flexh2o.planning import dtype_choice
from flexh2o.run_config import RunConfig


def _rc(percent=(100, 0, 100, 0)) -> RunConfig:
    return RunConfig(model=from_name("smollm2-135m"), percent=Percent(*percent), gpu_batch_size=2, prompt_len=8,
                     gen_len=12, gpu_mem=8 << 30, cpu_mem=8 << 30, disk_mem=8 << 30)


@pytest.mark.parametrize("dtype,percent", [("bfloat16", (100, 0, 100, 0)), ("float16", (100, 0, 100, 0)),
                                           ("auto", (0, 0, 100, 0)), ("auto", (100, 0, 100, 0))])
def test_every_relative_time_in_the_reason_is_finite(dtype, percent):
    got = dtype_choice.choose_dtypes(_rc(percent), dtype, "auto", probe=lambda: (FIXTURE_PROBE, True))
    times = re.search(r"relative linear time ([^)]*)\)", got.reason).group(1)
    figures = dict(part.split() for part in times.split(", "))
    assert figures and all(math.isfinite(float(v)) for v in figures.values()), got.reason
    assert "inf" not in got.reason and "nan" not in got.reason


def test_the_probe_never_measures_a_16_bit_to_16_bit_cast_and_no_choice_needs_one():
    assert not any("float32" not in k for k in FIXTURE_PROBE["convert"])  # as probe_timings measures
    for storage in ("bfloat16", "float16", None):
        for s, c, d in dtype_choice.options(_rc((0, 0, 100, 0)), storage and getattr(torch, storage), None):
            for a, b in ((s, c), (s, d)):
                assert a == b or torch.float32 in (a, b), (s, c, d)
