"""Peer baselines: Hugging Face transformers + Accelerate offloading, and plain transformers `generate`.

Same seeded dummy weights as flexh2o (taken from `Engine(...).weights.handles`), same synthetic prompts
(`flexh2o.prompts.synthetic_prompts`), same lengths, greedy decoding with EOS ignored, one untimed warm-up, and
one JSON record with the fields of `flexh2o-run --log-file`.

Memory caps on a CPU-only machine (see benchmarks/RESULTS.md): Accelerate knows the devices "cpu" and "disk" only.
flexh2o's weights live in its cpu tier, so `--cpu-mem` becomes `max_memory={"cpu": cpu_mem}` and whatever does not fit
goes to `offload_folder` (disk). flexh2o's gpu tier (KV cache, working buffers) has no Accelerate counterpart: its
KV cache grows in host memory without a cap, so equality is kept through the batch (the caller passes the batch
flexh2o `full` fits) and the peak RSS is recorded for comparison. `--gpu-mem` is only recorded.

    python benchmarks/baselines/hf_accelerate.py --mode accelerate --model opt-125m --batch-size 8 \
        --prompt-len 256 --gen-len 32 --cpu-mem 1GB --log-file out.jsonl

`--checkpoint DIR` keeps the converted checkpoint in DIR (written there when missing; `--prepare` writes it and
exits): benchmarks/compare.py writes it once, outside any memory cap, so that a capped run (--mem-cap) measures
generation and not the one-off copy of the dummy weights.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import psutil  # noqa: E402
import torch  # noqa: E402

from flexh2o import config as model_configs  # noqa: E402
from flexh2o.engine import Engine  # noqa: E402
from flexh2o.units import parse_bytes  # noqa: E402
from flexh2o.metrics import thread_settings  # noqa: E402
from flexh2o.placement import Percent  # noqa: E402
from flexh2o.prompts import synthetic_prompts  # noqa: E402
from flexh2o.dtypes import parse_dtype
from flexh2o.run_config import RunConfig  # noqa: E402


def hf_config(cfg, dtype: torch.dtype):
    """flexh2o ModelConfig (OPT) -> transformers OPTConfig."""
    from transformers import OPTConfig
    if cfg.family != "opt":
        raise ValueError(f"{cfg.name}: only OPT models are wired for the peer baseline")
    return OPTConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.num_layers,
                     num_attention_heads=cfg.num_heads, ffn_dim=cfg.ffn, max_position_embeddings=cfg.max_positions,
                     word_embed_proj_dim=cfg.embed_dim, do_layer_norm_before=cfg.norm_before,
                     pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                     tie_word_embeddings=True, enable_bias=True, dtype=dtype)


def dummy_state_dict(cfg, dtype: torch.dtype, seed: int) -> dict:
    """flexh2o's seeded dummy weights (HF state-dict names), copied out of an Engine's memory tiers."""
    rc = RunConfig(model=cfg, percent=Percent(0, 100, 100, 0), dtype=dtype, seed=seed, gpu_mem=1 << 40, cpu_mem=1 << 40,
                   disk_mem=0)
    with Engine(rc) as eng:
        return {name: t.clone() for name, t in eng.weights.handles.items()}


def write_checkpoint(cfg, dtype: torch.dtype, seed: int, ckpt: str) -> None:
    """flexh2o's seeded dummy weights as a transformers OPT checkpoint (save_pretrained) in `ckpt`."""
    from transformers import OPTForCausalLM
    sd = dummy_state_dict(cfg, dtype, seed)
    with torch.device("meta"):
        model = OPTForCausalLM(hf_config(cfg, dtype))
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weight names differ: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    tmp = ckpt + ".partial"
    model.save_pretrained(tmp)
    os.replace(tmp, ckpt)  # a checkpoint dir exists only once complete


def build_model(args, cfg, dtype: torch.dtype, workdir: str):
    """(model, how it was placed). Plain: all in memory. Accelerate: device_map="auto" under max_memory."""
    from transformers import OPTForCausalLM
    ckpt = args.checkpoint or os.path.join(workdir, "ckpt")
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        write_checkpoint(cfg, dtype, args.seed, ckpt)
    if args.mode == "plain":
        model = OPTForCausalLM.from_pretrained(ckpt, dtype=dtype)
        model.eval()
        return model, {"device_map": "all in memory (cpu)"}
    offload = os.path.join(workdir, "offload")
    max_memory = {"cpu": parse_bytes(args.cpu_mem)}
    model = OPTForCausalLM.from_pretrained(ckpt, device_map="auto", max_memory=max_memory, offload_folder=offload,
                                           dtype=dtype)
    model.eval()
    dmap = getattr(model, "hf_device_map", None) or {}  # absent when the whole model fits one device
    on_disk = [m for m, d in dmap.items() if d == "disk"]
    used = sorted({str(d) for d in dmap.values()}) or sorted({p.device.type for p in model.parameters()})
    return model, {"device_map": "auto", "max_memory": max_memory, "offload_folder": offload,
                   "devices_used": used, "modules_on_disk": len(on_disk),
                   "weight_bytes_on_disk": _disk_param_bytes(cfg, dtype, on_disk)}


def _disk_param_bytes(cfg, dtype: torch.dtype, on_disk: list) -> int:
    """Bytes of the weights Accelerate placed on "disk" (read from the checkpoint or offload folder per forward)."""
    from flexh2o.models import layer_specs
    size = torch.empty((), dtype=dtype).element_size()
    names = {s.name: s.numel for layer in layer_specs(cfg) for s in layer}
    return sum(n * size for name, n in names.items()
               if any(m == "" or name == m or name.startswith(m + ".") for m in on_disk))  # "": the whole model


class StepClock:
    """A logits processor: called once per generated token, right after that step's forward pass."""

    def __init__(self):
        self.times, self.proc = [], psutil.Process(os.getpid())
        self.peak_rss = self.proc.memory_info().rss

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
        return scores


def generate(model, ids: torch.Tensor, gen_len: int, clock=None) -> torch.Tensor:
    from transformers import LogitsProcessorList
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len,
                              min_new_tokens=gen_len, do_sample=False, num_beams=1, use_cache=True,
                              logits_processor=LogitsProcessorList([clock] if clock else []))


def run(args) -> dict:
    cfg = model_configs.from_name(args.model)
    dtype = parse_dtype(peer_dtype(args.dtype, args.batch_size, args.prompt_len, args.gen_len))
    ids = torch.tensor(synthetic_prompts(args.batch_size, args.prompt_len, cfg.vocab, args.seed))  # (b, t)
    os.makedirs(args.offload_dir, exist_ok=True)
    if args.prepare:
        if not args.checkpoint:
            raise SystemExit("hf_accelerate.py: --prepare needs --checkpoint DIR")
        if not os.path.exists(os.path.join(args.checkpoint, "config.json")):
            write_checkpoint(cfg, dtype, args.seed, args.checkpoint)
        return {}
    workdir = tempfile.mkdtemp(prefix="hf-peer-", dir=args.offload_dir)
    try:
        model, placement = build_model(args, cfg, dtype, workdir)
        if not args.no_warmup:
            generate(model, ids[:, :8], 2)
        clock = StepClock()
        start = time.perf_counter()
        out = generate(model, ids, args.gen_len, clock)
        assert out.shape == (args.batch_size, args.prompt_len + args.gen_len), out.shape
        disk = placement.get("weight_bytes_on_disk", 0)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return make_record(args, cfg, dtype, placement, clock, start, disk)


def peer_dtype(name: str, batch: int, prompt_len: int, gen_len: int) -> str:
    """The dtype name to run: `name`, or for auto the one the dtype probe finds fastest stored and computed alike."""
    if name != "auto":
        return name
    from flexh2o.planning.dtype_choice import fastest_uniform
    return fastest_uniform(batch, prompt_len, gen_len)


def make_record(args, cfg, dtype, placement, clock: StepClock, start: float, disk: int) -> dict:
    n, prefill_s, decode_s = args.batch_size, clock.times[0] - start, clock.times[-1] - clock.times[0]
    system = "transformers+accelerate" if args.mode == "accelerate" else "transformers"
    return {
        "model": cfg.name, "system": system,
        "policy": {"percent": None, "gpu_batch_size": n, "num_gpu_batches": 1, "kv_policy": "full", "heavy": None,
                   "recent": None, "dtype": str(dtype).replace("torch.", ""),
                   "compute_dtype": str(dtype).replace("torch.", ""), "device": "cpu", "path": "_DUMMY_",
                   "gpu_mem": parse_bytes(args.gpu_mem) if args.gpu_mem else None,
                   "cpu_mem": parse_bytes(args.cpu_mem) if args.mode == "accelerate" else None,
                   "placement": placement},
        "num_seqs": n, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
        "prefill_s": prefill_s, "decode_s": decode_s,
        "peak_bytes": {"gpu": 0, "cpu_rss": clock.peak_rss, "cpu_tier": None, "disk": disk},
        "moved_bytes_per_step": {}, "plan_bytes": {},
        "warmup": "none" if args.no_warmup else "one untimed warm-up generation (gen_len 2) before the timed run",
        "threads": thread_settings(), "predicted": {},
        "prefill_throughput": n * args.prompt_len / prefill_s,
        "decode_throughput": n * (args.gen_len - 1) / max(decode_s, 1e-9),
        "total_throughput": n * args.gen_len / (prefill_s + decode_s),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["accelerate", "plain"], default="accelerate")
    p.add_argument("--model", default="opt-125m")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--dtype", default="auto", help="weights and compute (transformers computes in its weights' "
                   "dtype); auto: the fastest such dtype here (flexh2o's cached dtype probe)")
    p.add_argument("--cpu-mem", default="8GB", help="Accelerate max_memory['cpu'] (weights); the rest to disk")
    p.add_argument("--gpu-mem", help="flexh2o's gpu-tier cap, recorded only (no such device for Accelerate here)")
    p.add_argument("--offload-dir", default=os.path.join(os.path.expanduser("~"), "flexh2o_offload"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-file")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--checkpoint", help="converted checkpoint dir to use, written there when missing")
    p.add_argument("--prepare", action="store_true", help="only write --checkpoint, then exit")
    args = p.parse_args(argv)
    rec = run(args)
    if args.prepare:
        print(f"checkpoint ready in {args.checkpoint}")
        return 0
    if args.log_file:
        with open(args.log_file, "a") as f:
            f.write(json.dumps(rec) + "\n")
    print(f"{rec['system']} {rec['model']} seqs {rec['num_seqs']} prompt {rec['prompt_len']} gen {rec['gen_len']}: "
          f"prefill {rec['prefill_s']:.3f} s  decode {rec['decode_s']:.3f} s  "
          f"total {rec['total_throughput']:.1f} tok/s  peak rss {rec['peak_bytes']['cpu_rss'] / 2**20:.0f} MiB  "
          f"placement {rec['policy']['placement']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
