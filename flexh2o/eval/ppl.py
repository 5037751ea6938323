"""Streaming perplexity with real eviction.

Each window of `context` tokens is read the way generation reads it: the first `prefix` tokens are the prompt
(prefill), then every later token is fed one per step through the engine's decode path, the KV policy evicting as it
goes. The logits of each step are scored against the next token of the text. Windows from every text form the GPU
batch of one run; each (policy, budget) is one run. Perplexity is reported over all scored tokens and over the
second half of each window ("late"), where every budget up to 50% is already evicting.

Lanes: every (policy, budget) is a lane of its own rows in a shared batch (kv/policies/lanes.py), so one engine pass
reads each weight once for many lanes; lanes are grouped into passes by cache size (`lane_passes`). A lane's figures
equal those of a run of its policy alone (tests/test_eval.py checks it).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Optional

import torch

from flexh2o.eval.common import (EVICTING, EvalResult, TEXTS, EvalModel, auto_lane_mem, budget_tokens, lane_passes,
                                 lanes_run, load_text, machine, progress_bar)


@dataclass(frozen=True)
class PplSettings:
    """What to measure. budgets: token counts ('64') or percentages of the context ('20%')."""

    texts: tuple = ("hamlet", "macbeth")
    context: int = 384
    windows: int = 8  # per text
    prefix: int = 1
    budgets: tuple = ("10%", "20%", "50%")
    policies: tuple = EVICTING
    lane_mem: Optional[float] = None  # bytes of KV cache per engine pass of lanes; None: auto_lane_mem
    separate: bool = False  # one engine pass per (policy, budget), as before lanes
    only_lanes: Optional[tuple] = None  # the (policy, budget tokens) lanes one process of --procs runs; None: all

    def __post_init__(self):
        if not 1 <= self.prefix < self.context:
            raise ValueError(f"--prefix must be between 1 and the context - 1 (got {self.prefix})")
        if self.windows < 1 or not self.texts:
            raise ValueError("give at least one text and one window per text")
        for p in self.policies:
            if p not in EVICTING:
                raise ValueError(f"unknown policy {p!r}: choose from {', '.join(EVICTING)}")
        for b in self.budgets:
            budget_tokens(b, self.context)
        if self.lane_mem is not None and self.lane_mem <= 0:
            raise ValueError(f"--lane-mem must be positive (got {self.lane_mem / 1e9:g} GB)")
        for t in self.texts:
            if t not in TEXTS and not os.path.isfile(t):
                raise ValueError(f"unknown text {t!r}: choose one of {', '.join(TEXTS)} or give a file path")


def text_windows(tokens: list, context: int, count: int) -> list:
    """`count` non-overlapping windows of `context` tokens, spread evenly over the text."""
    if count * context > len(tokens):
        raise ValueError(f"the text has {len(tokens)} tokens, too few for {count} windows of {context}: "
                         "lower --windows or --context")
    gap = (len(tokens) - count * context) // max(count - 1, 1) if count > 1 else 0
    return [tokens[i * (context + gap): i * (context + gap) + context] for i in range(count)]


def run_ppl(model: EvalModel, s: PplSettings, progress: bool = True, procs: int = 1) -> EvalResult:
    """Every policy at every budget, plus full, over the same windows: lanes of equal cache size share a pass.
    procs > 1: the lanes are split between that many processes (eval/parallel.py), each with its share of the
    torch threads; a lane's figures do not depend on which other lanes share its batch."""
    procs = min(procs, len(_lanes(_jobs(s))))
    if s.lane_mem is None:
        s = replace(s, lane_mem=auto_lane_mem(procs))
    if procs > 1:
        from flexh2o.eval.parallel import run_split
        return run_split(model, s, procs, progress)
    bar = progress_bar(_total_tokens(model, s), "ppl", progress)
    try:
        return ppl_rows(model, s, bar.update, bar.set_postfix_str)
    finally:
        bar.close()


def _total_tokens(model: EvalModel, s: PplSettings) -> int:
    """Scored tokens over every lane and row: what the progress bar counts."""
    lanes = _lanes(_jobs(s))
    return len(lanes) * (s.context - s.prefix) * s.windows * len(s.texts)


def _jobs(s: PplSettings) -> list:
    """(policy, budget as given, budget tokens) of every table cell, full first."""
    return [("full", None, None)] + [(p, b, budget_tokens(b, s.context)) for b in s.budgets for p in s.policies]


def _lanes(jobs: list) -> list:
    """The distinct (policy, budget tokens) lanes of `jobs` (50% of 1024 and 512 run once)."""
    return list(dict.fromkeys((p, tokens) for p, _, tokens in jobs))


def ppl_rows(model: EvalModel, s: PplSettings, tick=lambda n: None, note=lambda text: None) -> EvalResult:
    """run_ppl in this process; tick(n) after each decode step with the tokens it scored, note(text) per pass."""
    names, windows = [], []
    for text in s.texts:
        for w in text_windows(model.tokenizer.encode(load_text(text)), s.context, s.windows):
            names.append(text)
            windows.append(w)
    ids = torch.tensor(windows)  # (n, context)
    prompts, targets = ids[:, :s.prefix].tolist(), ids[:, s.prefix:]
    jobs = [j for j in _jobs(s) if s.only_lanes is None or (j[0], j[2]) in s.only_lanes]
    lanes = _lanes(jobs)
    mem = s.lane_mem if s.lane_mem is not None else auto_lane_mem()
    passes = lane_passes(model, lanes, s.prefix, targets.shape[1], len(windows), mem, s.separate)
    result = EvalResult("ppl", s, machine=machine())
    late = max(s.context // 2 - s.prefix, 0)  # first scored step predicting a token in the second half
    nll = {}
    for group in passes:
        note(f"{len(group)} lanes")
        done = lanes_run(model, group, prompts, targets, lambda _, k=len(group): tick(len(windows) * k))
        nll.update({lane: -logprob for lane, (logprob, _) in zip(group, done)})  # (n, steps) each
    for policy, spec, tokens in jobs:
        for text in s.texts:
            rows = torch.tensor([i for i, t in enumerate(names) if t == text])
            x = nll[policy, tokens][rows]
            result.rows.append({"policy": policy, "budget": spec or "all", "budget_tokens": tokens, "text": text,
                                "ppl": math.exp(x.mean().item()), "ppl_late": math.exp(x[:, late:].mean().item()),
                                "tokens": int(x.numel())})
    return result


def format_ppl(result: EvalResult, key: str = "ppl") -> str:
    """Markdown: one table per text, policies x budgets, perplexity and its change against full."""
    s, out = result.settings, []
    for text in s.texts:
        rows = [r for r in result.rows if r["text"] == text]
        full = next(r[key] for r in rows if r["policy"] == "full")
        head = [f"{b} ({budget_tokens(b, s.context)})" for b in s.budgets]
        out.append(f"{text}: {key}, {s.context}-token windows x {s.windows}, full cache {full:.3f}")
        out.append("| policy | " + " | ".join(head) + " |")
        out.append("|---|" + "---|" * len(head))
        for p in s.policies:
            cells = [_cell(_find(rows, p, b)[key], full) for b in s.budgets]
            out.append(f"| {p} | " + " | ".join(cells) + " |")
        best = [min(s.policies, key=lambda p: _find(rows, p, b)[key]) for b in s.budgets]
        out.append("| **best** | " + " | ".join(f"**{p}**" for p in best) + " |")
        out.append("")
    return "\n".join(out)


def _cell(value: float, full: float) -> str:
    return f"{value:.3f} ({(value / full - 1) * 100:+.1f}%)"


def _find(rows: list, policy: str, budget: str) -> dict:
    return next(r for r in rows if r["policy"] == policy and r["budget"] == budget)


def plot_ppl(result: EvalResult, path: str, key: str = "ppl") -> Optional[str]:
    """Perplexity vs budget per policy, one panel per text; None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    s = result.settings
    fig, axes = plt.subplots(1, len(s.texts), figsize=(5 * len(s.texts), 4), squeeze=False)
    for ax, text in zip(axes[0], s.texts):
        rows = [r for r in result.rows if r["text"] == text]
        for p in s.policies:
            pts = sorted((r["budget_tokens"], r[key]) for r in rows if r["policy"] == p)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
        ax.axhline(next(r[key] for r in rows if r["policy"] == "full"), color="k", ls="--", label="full")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("KV budget (tokens per layer and KV head)")
        ax.set_ylabel("perplexity" if key == "ppl" else "perplexity, second half")
        ax.set_title(f"{text} ({s.context}-token windows)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
