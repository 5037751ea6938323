"""Run report: throughput (FlexGen's definitions), peak memory per tier, bytes moved; the JSON record and summary."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

import psutil
import torch

from flexh2o.units import fmt_bytes


@dataclass
class RunReport:
    model: str
    policy: dict
    num_seqs: int
    prompt_len: int
    gen_len: int
    prefill_s: float
    decode_s: float
    peak_bytes: dict
    moved_bytes_per_step: dict
    plan_bytes: dict
    warmup: str = "one untimed warm-up generation (gen_len 2) before the timed run"
    threads: dict = field(default_factory=dict)
    predicted: dict = field(default_factory=dict)
    dtype_reason: str = ""
    measured_steps: int = 0  # generation steps run; fewer than gen_len (--cut-gen-len): decode is projected
    measured_decode_s: float = 0.0  # decode seconds of the steps run
    stages: list = field(default_factory=list)  # pipeline stages: per stage compute, I/O, waiting, bytes sent
    busy_s: dict = field(default_factory=dict)  # op kind -> seconds in its handlers, whole run ('stall': waits)
    decode_busy_s: dict = field(default_factory=dict)  # the same, decode steps only
    weight_seconds: dict = field(default_factory=dict)  # phase -> seconds reading / expanding weights (I/O threads)
    weight_kernel: dict = field(default_factory=dict)  # phase -> True where block matmuls ran the int4 kernel

    @property
    def prefill_throughput(self) -> float:
        return self.num_seqs * self.prompt_len / max(self.prefill_s, 1e-9)

    @property
    def decode_throughput(self) -> float:
        return self.num_seqs * max(self.gen_len - 1, 0) / max(self.decode_s, 1e-9)

    @property
    def total_throughput(self) -> float:
        """Generated tokens / (prefill + decode): the paper's and FlexGen's metric."""
        return self.num_seqs * self.gen_len / max(self.prefill_s + self.decode_s, 1e-9)

    @property
    def projected(self) -> bool:
        """Decode (and total) figures projected from a shortened run (FlexGen's --cut-gen-len)."""
        return 0 < self.measured_steps < self.gen_len

    def record(self) -> dict:
        d = asdict(self)
        d["projected"] = self.projected
        d.update(prefill_throughput=self.prefill_throughput, decode_throughput=self.decode_throughput,
                 total_throughput=self.total_throughput)
        if self.predicted.get("decode_throughput"):
            d["decode_ratio_measured_to_predicted"] = self.decode_throughput / self.predicted["decode_throughput"]
        if self.predicted.get("total_throughput"):
            d["total_ratio_measured_to_predicted"] = self.total_throughput / self.predicted["total_throughput"]
        if self.predicted.get("work"):
            d["efficiency"] = self.efficiency()
        return d

    def efficiency(self) -> dict:
        """efficiency() of the predicted step work (tuning/efficiency.py) over one measured step of each phase."""
        steps = {"prefill": self.prefill_s, "decode": self.decode_s / max(self.gen_len - 1, 1)}
        return efficiency(self.predicted["work"], steps if self.gen_len > 1 else {"prefill": self.prefill_s})

    def summary(self) -> str:
        peaks = "  ".join(f"{t} {fmt_bytes(b)}" for t, b in self.peak_bytes.items())
        moved = "  ".join(f"{t} {fmt_bytes(b)}" for t, b in self.moved_bytes_per_step.items())
        lines = [f"model {self.model}  seqs {self.num_seqs}  prompt {self.prompt_len}  gen {self.gen_len}",
                 f"policy {self.policy['kv_policy']}{_budget(self.policy)}  percent {self.policy['percent']}  "
                 f"batch {self.policy['gpu_batch_size']}x{self.policy['num_gpu_batches']}",
                 f"prefill  {self.prefill_s:8.3f} s  {self.prefill_throughput:10.1f} tok/s",
                 f"decode   {self.decode_s:8.3f} s  {self.decode_throughput:10.1f} tok/s" + self._projected(),
                 f"total    {self.prefill_s + self.decode_s:8.3f} s  {self.total_throughput:10.1f} tok/s (generated)"
                 + self._projected(),
                 "placement (actual bytes)  " + "  ".join(
                     f"{kind} " + "/".join(fmt_bytes(self.plan_bytes[t][kind]) for t in ("gpu", "cpu", "disk"))
                     for kind in ("weights", "cache", "activations")) + "  (gpu/cpu/disk)",
                 f"peak memory  {peaks}",
                 f"moved per step (logical bytes loaded from each home tier)  {moved}",
                 f"({self.warmup}; excluded from timings)"]
        if self.dtype_reason:
            dec = self.policy.get("decode_dtype", self.policy["compute_dtype"])
            phases = f"compute {self.policy['compute_dtype']}" + (
                f" (prefill), {dec} (decode)" if dec != self.policy["compute_dtype"] else "")
            lines.insert(2, f"dtypes  storage {self.policy['dtype']}  {phases}: {self.dtype_reason}")
        if self.weight_kernel and any(self.weight_kernel.values()) or self.decode_busy_s:
            lines.append(self._decode_split())
        lines += [stage_line(s) for s in self.stages]
        if self.predicted.get("work"):
            lines.append(efficiency_line(self.efficiency(), self.predicted["work"]))
        if self.predicted:
            lines.append(f"predicted total {self.predicted.get('total_throughput', 0):.1f} tok/s, decode "
                         f"{self.predicted.get('decode_throughput', 0):.1f} tok/s")
        return "\n".join(lines)

    def _decode_split(self) -> str:
        """Per decode step: seconds in compute, in loading weights (read vs expand), computes waiting for loads."""
        steps = max(self.measured_steps - 1, 1)
        w = self.weight_seconds.get("decode", {})
        kernel = ", ".join(f"{p} {'int4' if on else 'generic'}" for p, on in self.weight_kernel.items())
        busy = self.decode_busy_s
        line = (f"per decode step (busy, summed over threads)  compute {busy.get('compute', 0) / steps:.3f} s  "
                f"weights read {w.get('read', 0) / steps:.3f} s  expand {w.get('expand', 0) / steps:.3f} s  "
                f"stall {busy.get('stall', 0) / steps:.3f} s")
        return line + (f"  weight matmuls: {kernel}" if kernel else "")

    def _projected(self) -> str:
        if not self.projected:
            return ""
        return (f"  PROJECTED from {self.measured_steps} of {self.gen_len} steps (measured decode "
                f"{self.measured_decode_s:.3f} s over {self.measured_steps - 1} steps)")


def efficiency(work: dict, seconds: dict) -> dict:
    """phase -> one step's FLOPs, bytes per link, and their rates as % of the profile's peaks (work['peaks']), from
    a step's work (tuning/efficiency.step_work) and `seconds`: phase -> the measured seconds of one step."""
    peaks, out = work.get("peaks", {}), {}
    for phase, sec in seconds.items():
        w = work[phase]
        if sec <= 0:
            continue
        got = {"step_s": sec, "flops": w["flops"], "flops_per_s": w["flops"] / sec, "bytes": w["bytes"]}
        if peaks.get(phase):
            got["matmul_peak_pct"] = 100.0 * w["flops"] / sec / peaks[phase]
        for link, nbytes in w["bytes"].items():
            if nbytes and peaks.get(link):
                got[f"{link}_pct"] = 100.0 * nbytes / sec / peaks[link]
        out[phase] = got
    return out


def efficiency_line(eff: dict, work: dict) -> str:
    """One line: per phase, a step's FLOP rate and its % of the dtype's matmul peak, and each link's % of its rate."""
    parts = []
    for phase, e in eff.items():
        pct = f" = {e['matmul_peak_pct']:.0f}% of {work[phase]['dtype']}'s matmul peak" if "matmul_peak_pct" in e \
            else ""
        links = "".join(f", {k[:-4]} {v:.0f}%" for k, v in e.items() if k.endswith("_pct") and k != "matmul_peak_pct")
        parts.append(f"{phase} {e['flops'] / 1e9:.3g} GFLOP/step at {e['flops_per_s'] / 1e9:.3g} GFLOP/s{pct}{links}")
    return "efficiency (one step; profile peaks)  " + "  |  ".join(parts)


def stage_line(s: dict) -> str:
    """One pipeline stage: where its time went (waiting = the pipeline bubble) and what it sent to the next."""
    return (f"stage {s['stage']} ({s['layers'].split(': ', 1)[-1]})  compute {s['compute_s']:.3f} s  I/O "
            f"{s['io_s']:.3f} s (compute stalled {s['io_stall_s']:.3f} s)  waiting {s['wait_s']:.3f} s  sent "
            f"{fmt_bytes(s['sent_bytes_prefill'])} prefill + {fmt_bytes(s['sent_bytes_per_decode_step'])} per "
            "decode step")


class RssPeak:
    """This process's peak resident memory (the cpu tier's honest peak, torch and Python included): the kernel's
    high-water mark of its memory (VmHWM in /proc/self/status), which sees the transients between samples (h2o-q4 on
    opt-1.3b: sampled at each step 1,004 MiB, the kernel's peak 1,653 MiB, its weights' load), or the samples where
    there is none. Not getrusage's ru_maxrss: that keeps the peak of the process that spawned this one (a run started
    by a 4.8 GB test worker reported 4.8 GB)."""

    def __init__(self):
        self.proc = psutil.Process(os.getpid())
        self.sampled = self.proc.memory_info().rss

    def sample(self, *_):
        self.sampled = max(self.sampled, self.proc.memory_info().rss)

    @property
    def peak(self) -> int:
        return max(self.sampled, high_water_mark())


def high_water_mark() -> int:
    """Bytes of this process's peak resident memory as the kernel kept it (VmHWM; 0 where there is no /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return 0


def peak_bytes(eng, rss: RssPeak) -> dict:
    gpu = torch.cuda.max_memory_allocated() if eng.device.type == "cuda" else eng.tiers["gpu"].peak
    out = {"gpu": gpu, "cpu_rss": rss.peak, "cpu_tier": eng.tiers["cpu"].peak}
    out["disk"] = eng.tiers["disk"].peak if "disk" in eng.tiers else 0
    return out


def thread_settings() -> dict:
    return {"torch_threads": torch.get_num_threads(), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", ""),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "")}


def append_json_line(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _budget(policy: dict) -> str:
    """' (budget N tokens: heavy H, recent R)' of a run's policy flags; '' for an unbounded cache."""
    if policy.get("heavy") is None:
        return ""
    h, r = policy["heavy"], policy["recent"]
    return f" (budget {h + r} tokens: heavy {h}, recent {r})"
