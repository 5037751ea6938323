"""The process group of a pipeline job launched by torchrun: who this rank is, the backend, agreement on
pre-flight refusals, and gathering per-stage figures to the rank holding the head."""
from __future__ import annotations

import datetime
import os
import signal
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


def launched_by_torchrun() -> bool:
    """True when torchrun's environment names more than one rank (one rank is the single-process engine)."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def ranks_here() -> int:
    """Ranks torchrun started on this machine (LOCAL_WORLD_SIZE; 1 outside torchrun): they share its memory and
    disk."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) if launched_by_torchrun() else 1


def machine_share(device: str, gpu: int, cpu: int, disk: int) -> tuple:
    """This rank's share of default capacities measured for the whole machine: host memory (the cpu tier, and the
    gpu tier on a CPU) and the offload disk are split between the ranks on this machine; a CUDA device's memory
    between the ranks that share it (rank_device: one device per local rank, round robin)."""
    n = ranks_here()
    per_gpu = -(-n // max(1, torch.cuda.device_count())) if device.startswith("cuda") else n
    return gpu // per_gpu, cpu // n, disk // n


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))


def env_rank() -> tuple:
    """(rank, world size) from torchrun's environment, before (or without) joining the process group."""
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def rank_device(device: str) -> torch.device:
    """This rank's compute device: on CUDA one device per local rank, else the device named."""
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank() % torch.cuda.device_count())
    return dev


@dataclass
class StageGroup:
    """This rank in the job: `control` is a gloo group for small objects whatever the data backend."""

    rank: int
    world: int
    backend: str
    device: torch.device
    control: object

    @staticmethod
    def start(device: str, timeout_s: float) -> "StageGroup":
        """Join the job torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): NCCL when compute is on
        CUDA (one device per local rank), else gloo."""
        dev = rank_device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
        return StageGroup(dist.get_rank(), dist.get_world_size(), backend, dev, control)

    def agree(self, refusal: Optional[str]) -> None:
        """Every rank says whether it can run; if any cannot, every rank raises the first refusal (with its rank)."""
        said = [None] * self.world
        dist.all_gather_object(said, refusal, group=self.control)
        for rank, msg in enumerate(said):
            if msg is not None:
                raise ValueError(msg if self.world == 1 else f"rank {rank}: {msg}")

    def gather(self, obj, dst: int) -> Optional[list]:
        """Every rank's `obj` at rank `dst` (None elsewhere)."""
        out = [None] * self.world if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst, group=self.control)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def terminate_as_interrupt() -> None:
    """SIGTERM (what torchrun sends the other ranks when one fails or it is stopped) unwinds like Ctrl-C, so every
    rank's `finally` blocks remove its offload files; the first stop signal makes later ones ignored."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)


def ignore_stop_signals() -> None:
    """The job is ending: let the cleanup run to its end (a second SIGTERM or Ctrl-C would cut it short)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def _stop(signum, frame):
    ignore_stop_signals()
    raise KeyboardInterrupt
