"""When the policy search finds no placement, the answer is the least that would fit (tuning/least.py), and that
least is exact: one byte more in the tier and the search finds a placement, one byte less and it finds none."""
from __future__ import annotations

import re

import pytest
import torch

from flexh2o.cli import run as cli
from flexh2o.config import from_name
from flexh2o.placement import Percent
from flexh2o.planning.memory_plan import plan_memory
from flexh2o.run_config import RunConfig
from flexh2o.tuning.hardware import load_profile
from flexh2o.tuning.least import least_message, least_plan
from flexh2o.tuning.search import search

MiB = 1 << 20


def _rc(gpu_mem: int, model: str = "opt-1.3b") -> RunConfig:
    return RunConfig(model=from_name(model), percent=Percent.parse([100, 0, 100, 0, 100, 0]), gpu_batch_size=1,
                     prompt_len=64, gen_len=8, dtype=torch.float16, compute_dtype=torch.float32, gpu_mem=gpu_mem,
                     cpu_mem=8 << 30, disk_mem=100 << 30)


@pytest.mark.parametrize("model", ["opt-125m", "opt-1.3b"])
def test_the_least_is_the_search_boundary(model):
    hw = load_profile("cpu_measured")
    need = least_plan(_rc(16 * MiB, model)).total("gpu")  # a cap nothing fits: the least is the smallest need
    found = search(_rc(need, model), hw, limit=1)
    assert found and plan_memory(found[0][0]).overflow() is None
    assert plan_memory(found[0][0]).total("gpu") <= need
    assert search(_rc(need - 1, model), hw, limit=1) == []
    assert least_message(_rc(need, model)) is None
    msg = least_message(_rc(need - 1, model))
    assert "raise --gpu-mem to at least" in msg and f"({need} bytes)" in msg


@pytest.mark.parametrize("cap", ["16MiB", "20MiB"])
def test_policy_auto_names_the_least_not_the_default_placement(cap, capsys, offload_dir):
    args = ["--model", "opt-1.3b", "--prompt-len", "64", "--gen-len", "8", "--dtype", "float16", "--compute-dtype",
            "float32", "--gpu-mem", cap, "--cpu-mem", "8GB", "--disk-mem", "100GB", "--policy", "auto",
            "--hardware", "cpu_measured", "--offload-dir", offload_dir, "--no-warmup"]
    assert cli.main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1, err  # one error line (a warning about the shipped profile may precede it)
    err = err[0]
    need = least_plan(_rc(16 * MiB)).total("gpu")  # the same least whatever the cap
    # the gpu tier, named as a CPU-only run names it (compute memory) or a CUDA run
    m = re.search(r"needs ([\d.]+ \w+) in (?:the gpu tier|compute memory \(host memory, --gpu-mem\)) .*at least "
                  r".* \((\d+) bytes\)", err)
    assert m, err
    # less than two decoder layers in fp32: the weights on the cpu tier are used in place, the fp16 vocabulary
    # table gathered and multiplied from its stored form (weights/stored_form.py), the blocks' matmul weights
    # converted on use a chunk at a time (weights/on_use.py); 157 and 315 MiB fit since (two fp32 blocks: 384 MiB)
    block = 4 * (4 * 2048 * 2048 + 2 * 2048 * 8192)
    assert int(m.group(2)) == need and 16 * MiB < need < block
    assert "2.6 GiB" not in err  # not the default placement's need
