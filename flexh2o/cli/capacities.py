"""The tier capacities a run plans with: --gpu-mem/--cpu-mem/--disk-mem, or this machine's defaults."""
from __future__ import annotations

import os

import torch

from flexh2o.cli.checks import check_host_capacity
from flexh2o.pipeline.group import machine_share, ranks_here
from flexh2o.units import parse_bytes


def capacities(args, device: str) -> tuple:
    """(gpu, cpu, disk) tier capacities in bytes: the flags, else defaults from what this process may use (its memory
    cgroup's limit where one is set, free disk under --offload-dir), shared among torchrun's ranks on this machine."""
    from flexh2o.planning.memory_limit import available_bytes
    avail = available_bytes()  # inside a memory cgroup: its limit less what the group holds (this process included)
    if device.startswith("cuda"):
        gpu_default = torch.cuda.mem_get_info()[0]
        cpu_default = int(avail * 0.9)
    else:  # the gpu tier is host memory: give it part of what is free, the cpu tier the rest
        gpu_default, cpu_default = int(avail * 0.4), int(avail * 0.5)
    disk_default = 0
    if args.disk_mem is None:
        from flexh2o.storage.offload_dir import free_disk_bytes
        probe = args.offload_dir
        while probe and not os.path.exists(probe):
            probe = os.path.dirname(probe)
        disk_default = free_disk_bytes(probe or ".")
    # torchrun's ranks on one machine share it: each plans with its share of the defaults
    gpu_default, cpu_default, disk_default = machine_share(device, gpu_default, cpu_default, disk_default)
    caps = (parse_bytes(args.gpu_mem) if args.gpu_mem is not None else gpu_default,
            parse_bytes(args.cpu_mem) if args.cpu_mem is not None else cpu_default,
            parse_bytes(args.disk_mem) if args.disk_mem is not None else disk_default)
    if not getattr(args, "dry_run", False):  # a dry run may plan for a larger machine (e.g. the paper's 208 GB)
        check_host_capacity(device, caps[0], caps[1], ranks_here())
    return caps
