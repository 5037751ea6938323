"""torchrun's ranks on one machine share its memory and disk: each rank's --dry-run plans with its share of the
default capacities (LOCAL_WORLD_SIZE ranks), never the whole machine each; explicit capacities that add up to more
than the machine are refused."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import psutil
import pytest

from dist_util import free_port, rank_env
from flexh2o.cli import run as cli
from flexh2o.pipeline.group import machine_share
from flexh2o.units import GiB

DRY = ["--model", "opt-125m", "--percent", "0", "100", "100", "0", "--prompt-len", "8", "--gen-len", "2",
       "--gpu-batch-size", "1", "--dtype", "float32", "--compute-dtype", "float32", "--dry-run"]
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def _capacity_column(out: str) -> dict:
    """{tier: capacity in bytes (as printed, 0.1 of a unit)} from a --dry-run plan."""
    caps = {}
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0] in ("gpu", "cpu", "disk") and cells[-1] in UNITS:
            caps[cells[0]] = float(cells[-2]) * UNITS[cells[-1]]
    assert sorted(caps) == ["cpu", "disk", "gpu"], out
    return caps


@pytest.fixture
def fixed_machine(monkeypatch):
    """A machine with 10 GiB of available memory and 8 GiB free on the offload disk."""
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=10 * GiB))
    import flexh2o.storage.offload_dir as offload_dir
    monkeypatch.setattr(offload_dir, "free_disk_bytes", lambda path: 8 * GiB)


def _plan(capsys, offload_dir, env: dict, monkeypatch) -> dict:
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli.main(DRY + ["--offload-dir", offload_dir]) == 0
    return _capacity_column(capsys.readouterr().out)


@pytest.mark.parametrize("ranks", [2, 3])
def test_each_local_rank_plans_with_its_share_of_the_defaults(capsys, offload_dir, monkeypatch, fixed_machine,
                                                              ranks):
    whole = _plan(capsys, offload_dir, {}, monkeypatch)
    for rank in range(ranks):  # a dry run under torchrun joins no process group: each rank plans alone
        env = {k: v for k, v in rank_env(rank, ranks, 0).items() if k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
        mine = _plan(capsys, offload_dir, env, monkeypatch)
        for tier in ("gpu", "cpu", "disk"):
            # printed to 0.1 of a unit (1.3 GiB for 4.0 / 3)
            assert mine[tier] == pytest.approx(whole[tier] / ranks, rel=0.04), (tier, rank, whole, mine)


def test_two_processes_on_two_machines_each_plan_with_the_whole_machine(capsys, offload_dir, monkeypatch,
                                                                        fixed_machine):
    whole = _plan(capsys, offload_dir, {}, monkeypatch)
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}  # torchrun --nnodes 2 --nproc-per-node 1
    assert _plan(capsys, offload_dir, env, monkeypatch) == whole


def test_machine_share_splits_a_cuda_device_only_between_the_ranks_on_it(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    import torch
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # 4 ranks on 2 GPUs: 2 ranks per device
    assert machine_share("cuda", 80, 400, 1000) == (40, 100, 250)
    assert machine_share("cpu", 80, 400, 1000) == (20, 100, 250)


def test_explicit_capacities_of_the_ranks_together_may_not_exceed_the_machine(capsys, offload_dir, monkeypatch):
    have = psutil.virtual_memory().total + psutil.swap_memory().total
    each = f"{int(have * 0.6) >> 20}MB"  # one rank may count on it, two may not
    argv = DRY[:-1] + ["--cpu-mem", each, "--gpu-mem", "1MB", "--offload-dir", offload_dir]
    from flexh2o.cli.checks import check_host_capacity
    check_host_capacity("cpu", 1 << 20, int(have * 0.6))  # one rank: accepted
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "x 2 ranks on this machine" in err[0] and "--cpu-mem" in err[0], err


# slow: launches torchrun; each rank's share in one process: the tests above
@pytest.mark.slow
def test_torchrun_two_ranks_each_plan_half_the_disk(offload_dir, tmp_path):
    """The real launcher: each rank's disk tier capacity is half the offload disk's free space (which other
    processes change far less than the memory available)."""
    one = subprocess.run([sys.executable, "-m", "flexh2o.cli"] + DRY + ["--offload-dir", offload_dir],
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    env = dict(os.environ, **{k: v for k, v in rank_env(0, 2, 0).items() if k.startswith(("OMP", "GLOO"))})
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(free_port()), "-m", "flexh2o.cli"] + DRY
                         + ["--offload-dir", offload_dir], capture_output=True, text=True, env=env, timeout=300)
    assert two.returncode == 0, two.stderr
    whole = _capacity_column(one.stdout)["disk"]
    # each rank's plan begins with its header; two processes write to one pipe, so under load a header can follow
    # the other rank's last line before that line's newline ("... full 4084rank 1 of 2, stage 1: ...")
    blocks = re.split(r"(?=rank \d of 2, stage)", two.stdout)[1:]
    assert len(blocks) == 2, two.stdout
    for block in blocks:
        assert _capacity_column(block)["disk"] == pytest.approx(whole / 2, rel=0.03), (whole, block)


def test_machine_share_outside_torchrun_is_the_whole_machine(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # without RANK/WORLD_SIZE > 1 this is not a torchrun job
    assert machine_share("cpu", 1, 2, 3) == (1, 2, 3)
