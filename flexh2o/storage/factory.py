"""Builds the three tiers of a run from its RunConfig."""
from __future__ import annotations

import torch

from flexh2o.storage.memory import MemoryTier


def make_tiers(rc, need_disk: bool) -> dict:
    """gpu = the compute device (host memory with an enforced capacity on a CPU-only run), cpu = host memory
    (pinned when CUDA is present, unless --pin-weight false), disk = files in a fresh locked run directory under
    --offload-dir (only when used; removed with its lock by the tier's close(), also when the tier cannot be
    made)."""
    device = torch.device(rc.device)
    tiers = {"gpu": MemoryTier("gpu", device, rc.gpu_mem),
             "cpu": MemoryTier("cpu", torch.device("cpu"), rc.cpu_mem, pin=device.type == "cuda" and rc.pin_weight)}
    if need_disk:
        from flexh2o.storage.disk import DiskTier
        from flexh2o.storage.offload_dir import make_run_dir
        tiers["disk"] = DiskTier(make_run_dir(rc.offload_dir), rc.disk_mem)
    return tiers


def close_tiers(tiers: dict) -> None:
    """Close every tier of `tiers` (the disk tier removes its run directory); closing twice is harmless."""
    for tier in tiers.values():
        tier.close()
