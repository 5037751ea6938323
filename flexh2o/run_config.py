"""RunConfig: everything one run needs, validated once, built by the CLI (or by tests and benchmarks directly)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Optional

import torch

from flexh2o import paths
from flexh2o.compress import CompressionSpec
from flexh2o.compress.kernels import kernel_spec_ok
from flexh2o.config import ModelConfig
from flexh2o.kv.layout import CacheQuant
from flexh2o.kv.spec import KVSpec
from flexh2o.models import family_module, layer_specs
from flexh2o.placement import Percent, Placement
from flexh2o.storage.freed_memory import MAPPED_FROM
from flexh2o.weights.format import CheckpointReader
from flexh2o.weights.kept_run import with_kept_blocks

PREFILL_BYTES = 32 << 20  # on CUDA: target size of one prefill sub-batch's transient buffers


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: ModelConfig
    percent: Percent = field(default_factory=Percent)
    gpu_batch_size: int = 1
    num_gpu_batches: int = 1
    prompt_len: int = 32
    gen_len: int = 8
    path: str = "_DUMMY_"
    dtype: torch.dtype = torch.float16  # storage of weights and cache
    compute_dtype: Optional[torch.dtype] = None  # None: dtype on CUDA; float32 on CPU when dtype is float16
    decode_dtype: Optional[torch.dtype] = None  # decode steps' compute dtype; None: the compute dtype (prefill's)
    device: str = "cpu"
    overlap: bool = True
    cpu_cache_compute: bool = False
    kv: KVSpec = field(default_factory=KVSpec)
    seed: int = 0  # dummy weights
    gpu_mem: int = 4 << 30
    cpu_mem: int = 16 << 30
    disk_mem: int = 64 << 30
    offload_dir: str = field(default_factory=paths.offload_dir)  # flexh2o/paths.py
    attn_chunk: int = 256  # prefill queries per attention chunk
    io_threads: int = 2
    max_positions: Optional[int] = None  # allow going past the model's table (Llama only)
    prefill_batch: Optional[int] = None  # sequences per prefill sub-batch; None: prefill_rows() chooses
    compress_weight: Optional[CompressionSpec] = None  # weights of 2+ dimensions, grouped along its group_dim
    compress_cache: Optional[CacheQuant] = None  # K and V (kv/layout.py); a CompressionSpec is FlexGen's scheme
    weight_kernel: str = "auto"  # weights grouped along dim 1: the int4 kernel per phase by a probe, always, or never
    pin_weight: bool = True  # pin the cpu tier's memory when compute is on CUDA (FlexGen's --pin-weight)
    checkpoint: Optional[CheckpointReader] = field(default=None, compare=False, repr=False)  # path's, opened once


    def __post_init__(self):
        object.__setattr__(self, "compress_cache", CacheQuant.of(self.compress_cache))
        family_module(self.model.family)  # ValueError naming the declared families for any other
        for name in ("gpu_batch_size", "num_gpu_batches", "prompt_len", "gen_len", "attn_chunk", "io_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})")
        if self.weight_kernel not in ("auto", "int4", "generic"):
            raise ValueError(f"--weight-kernel {self.weight_kernel}: choose auto, int4 or off")
        if self.weight_kernel == "int4" and not kernel_spec_ok(self.compress_weight):
            raise ValueError("--weight-kernel int4 needs --compress-weight with 4 bits grouped along the input "
                             "dimension (groups of 32/64/128/256)")
        limit = self.max_positions or self.model.max_positions
        if self.prompt_len + self.gen_len > limit:
            raise ValueError(f"prompt {self.prompt_len} + gen {self.gen_len} tokens exceed the model's {limit} "
                             "positions: shorten the prompts (--prompt-len, or those of --prompt-file) or --gen-len")
        if self.max_positions and self.model.family == "opt" and self.max_positions > self.model.max_positions:
            raise ValueError("OPT has learned positions: it cannot run past its "
                             f"{self.model.max_positions}-token table")
        object.__setattr__(self, "checkpoint", opened(self.path, self.checkpoint))

    @property
    def num_seqs(self) -> int:
        return self.gpu_batch_size * self.num_gpu_batches

    @property
    def compute(self) -> torch.dtype:
        if self.compute_dtype is not None:
            return self.compute_dtype
        if self.device == "cpu" and self.dtype == torch.float16:
            return torch.float32  # fp16 matmul is ~100x slower than fp32 on CPU
        return self.dtype

    @property
    def decode_compute(self) -> torch.dtype:
        """The compute dtype of decode steps (a per-phase choice may compute them in the storage dtype)."""
        return self.decode_dtype or self.compute

    def compute_at(self, step: int) -> torch.dtype:
        """The compute dtype of generation step `step` (0 = prefill)."""
        return self.compute if step == 0 else self.decode_compute

    @cached_property
    def placement(self) -> Placement:
        """Home tiers of every weight, cache block and activation block (computed once per model, percent and
        number of GPU batches; `with_` carries it over when those do not change)."""
        return Placement.build(layer_specs(self.model), self.percent, self.num_gpu_batches)

    def placed(self, placement: Placement) -> "RunConfig":
        """This config with `placement` as its placement (a search builds many with a shared memo)."""
        new = replace(self)
        new.__dict__["placement"] = placement
        return new

    def cache_slots(self) -> int:
        """The largest layer's cache slots per sequence and KV head."""
        return max(self.layer_slots())

    def layer_slots(self) -> tuple:
        """Cache slots per sequence and KV head of each decoder layer (ModelConfig.layer_slots of the policy's)."""
        return self.model.layer_slots(self.kv.slots(self.prompt_len, self.gen_len, self.model.num_layers))

    def prefill_rows(self) -> int:
        """Sequences prefilled together, so a layer's transient buffers stay bounded however large the GPU batch
        is. On the CPU each buffer of one value per token and channel (q, k, v, the attention output, the residual)
        stays under glibc's mmap threshold (storage/freed_memory.MAPPED_FROM): buffers under it are reused from
        the heap, larger ones are mapped and faulted in afresh at every layer (memory-resident opt-1.3b bf16, 8
        prompts of 512: prefill 17.4 s in sub-batches of 2, 4 MiB buffers, against 11.8 s one prompt at a time,
        medians of alternated runs; system time 18 s -> 4 s). On CUDA the buffers together stay near
        PREFILL_BYTES."""
        if self.prefill_batch:
            return min(self.prefill_batch, self.gpu_batch_size)
        per_buffer = self.prompt_len * self.model.token_width * self.compute.itemsize
        rows = (MAPPED_FROM - 1) // per_buffer if self.device == "cpu" else PREFILL_BYTES // (6 * per_buffer)
        return max(1, min(self.gpu_batch_size, rows))

    def with_(self, **kw) -> "RunConfig":
        new = replace(self, **kw)
        if "placement" in self.__dict__ and not {"model", "percent", "num_gpu_batches"} & set(kw):
            new.__dict__["placement"] = self.__dict__["placement"]
        return new


def opened(path: str, checkpoint: Optional[CheckpointReader]) -> Optional[CheckpointReader]:
    """The converted checkpoint at `path`, opened and validated once (`checkpoint` where it is already that one:
    `with_` and `replace` carry it over); None for seeded dummy weights."""
    if path == "_DUMMY_":
        return None
    if checkpoint is not None and checkpoint.path == os.path.abspath(path):
        return checkpoint
    return CheckpointReader(path)


def opened_with_kept(path: str, checkpoint: Optional[CheckpointReader],
                     spec: Optional[CompressionSpec]) -> tuple:
    """(the checkpoint at `path` opened once (`opened`), --compress-weight's `spec` joined with the blocks it keeps
    (weights/kept_run.with_kept_blocks)): a RunConfig's `checkpoint` and `compress_weight`; (None, `spec`) for
    seeded dummy weights."""
    checkpoint = opened(path, checkpoint)
    return checkpoint, (spec if checkpoint is None else with_kept_blocks(spec, checkpoint))
