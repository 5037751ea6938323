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

from dataclasses import replace
from typing import Optional

from flexh2o.eval.common import EvalResult, EvalModel, auto_lane_mem, budget_tokens, progress_bar
from flexh2o.eval.parallel import run_split
from flexh2o.eval.ppl_rows import PplSettings, distinct_lanes, ppl_rows, table_jobs, total_tokens

__all__ = ["PplSettings", "run_ppl", "format_ppl", "plot_ppl"]


def run_ppl(model: EvalModel, s: PplSettings, progress: bool = True, procs: int = 1) -> EvalResult:
    """Every policy at every budget, plus full, over the same windows: lanes of equal cache size share a pass.
    procs > 1: the lanes are split between that many processes (eval/parallel.py), each with its share of the
    torch threads; a lane's figures do not depend on which other lanes share its batch."""
    procs = min(procs, len(distinct_lanes(table_jobs(s))))
    if s.lane_mem is None:
        s = replace(s, lane_mem=auto_lane_mem(procs))
    if procs > 1:
        return run_split(model, s, procs, progress)
    bar = progress_bar(total_tokens(model, s), "ppl", progress)
    try:
        return ppl_rows(model, s, bar.update, bar.set_postfix_str)
    finally:
        bar.close()


def format_ppl(result: EvalResult, key: str = "ppl", full_name: str = "full cache") -> str:
    """Markdown: one table per text, policies x budgets, perplexity and its change against full (`full_name`: what
    that run's cache was, e.g. quantized: eval.common.full_name)."""
    s, out = result.settings, []
    for text in s.texts:
        rows = [r for r in result.rows if r["text"] == text]
        full = next(r[key] for r in rows if r["policy"] == "full")
        head = [f"{b} ({budget_tokens(b, s.context)})" for b in s.budgets]
        out.append(f"{text}: {key}, {s.context}-token windows x {s.windows}, {full_name} {full:.3f}")
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
