"""One process's share of the perplexity table: the settings, the windows of each text, the table's cells and
lanes, and the rows computed here (eval/ppl.py runs them in one process or splits them, eval/parallel.py)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from flexh2o.eval.common import (EVICTING, EvalResult, TEXTS, EvalModel, auto_lane_mem, budget_tokens, check_policy,
                                 lane_passes, lanes_run, load_text, machine)


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
            check_policy(p)
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


def total_tokens(model: EvalModel, s: PplSettings) -> int:
    """Scored tokens over every lane and row: what the progress bar counts."""
    lanes = distinct_lanes(table_jobs(s))
    return len(lanes) * (s.context - s.prefix) * s.windows * len(s.texts)


def table_jobs(s: PplSettings) -> list:
    """(policy, budget as given, budget tokens) of every table cell, full first."""
    return [("full", None, None)] + [(p, b, budget_tokens(b, s.context)) for b in s.budgets for p in s.policies]


def distinct_lanes(jobs: list) -> list:
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
    jobs = [j for j in table_jobs(s) if s.only_lanes is None or (j[0], j[2]) in s.only_lanes]
    lanes = distinct_lanes(jobs)
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
