"""Synthetic recall: facts stated early, filler text, a question at the end; exact match of the greedy answer.

Tasks: `passkey` (one 5-digit pass key) and `kv` (several "The code of NAME is NNNN." facts, one asked for).
The facts and the filler are the prompt: prefill reads them and the policy cuts the cache to the budget at its end,
scoring tokens by the attention they received so far. The question and the answer are then fed one token per step
through the decode path (teacher forcing). The answer counts as recalled when the argmax of every answer step is the
answer token, which is exactly when greedy decoding would produce the answer. H2O picks its heavy hitters before it
has seen the question, so nothing steers it towards the fact that will be asked for.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from flexh2o.eval.common import (EVICTING, EvalResult, EvalModel, auto_lane_mem, budget_tokens, check_policy,
                                 lane_passes, lanes_run, load_text, machine, progress_bar)

TASKS = ("passkey", "kv")
NAMES = ("Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Jack", "Kate", "Laura", "Mark",
         "Nina", "Oscar", "Paul", "Rachel", "Sam", "Tom", "Victor", "Anna")


@dataclass(frozen=True)
class RecallSettings:
    """What to measure. budgets: token counts or percentages of the context (facts + filler)."""

    tasks: tuple = TASKS
    filler: str = "julius_caesar"
    context: int = 384
    samples: int = 16  # per task
    num_facts: int = 2  # kv task
    budgets: tuple = ("10%", "20%", "50%")
    policies: tuple = EVICTING
    seed: int = 0

    def __post_init__(self):
        for t in self.tasks:
            if t not in TASKS:
                raise ValueError(f"unknown recall task {t!r}: choose from {', '.join(TASKS)}")
        for p in self.policies:
            check_policy(p)
        if self.samples < 1 or not 1 <= self.num_facts <= len(NAMES):
            raise ValueError(f"--samples must be positive and --facts between 1 and {len(NAMES)}")
        for b in self.budgets:
            budget_tokens(b, self.context)


@dataclass
class Sample:
    task: str
    prompt: list  # facts + filler token ids
    forced: list  # question + answer token ids
    answer_start: int  # index in `forced` of the first answer token


def make_samples(tok, s: RecallSettings) -> list:
    """`samples` of each task, seeded; every task's forced part has one length, so each task is one batch."""
    rng = random.Random(s.seed)
    text = load_text(s.filler)
    names = [n for n in NAMES if len(tok.encode(" " + n)) == 1] or list(NAMES)
    out = []
    for task in s.tasks:
        for _ in range(s.samples):
            facts, question, answer = _passkey(rng) if task == "passkey" else _kv(rng, names, s.num_facts)
            head = tok.encode(facts)
            prompt = head + _filler(tok, text, rng, s.context - len(head))
            q, a = tok.encode(question), tok.encode(answer)
            out.append(Sample(task, prompt, q + a, len(q)))
    return out


def _passkey(rng: random.Random) -> tuple:
    key = rng.randrange(10000, 100000)
    facts = (f"There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n"
             f"The pass key is {key}. Remember it. {key} is the pass key.\n\n")
    return facts, "\n\nWhat is the pass key? The pass key is ", str(key)


def _kv(rng: random.Random, names: list, count: int) -> tuple:
    who = rng.sample(names, count)
    codes = [rng.randrange(1000, 10000) for _ in who]
    facts = "Remember these codes. " + " ".join(f"The code of {n} is {c}." for n, c in zip(who, codes)) + "\n\n"
    j = rng.randrange(count)
    return facts, f"\n\nWhat is the code of {who[j]}? The code of {who[j]} is ", str(codes[j])


def _filler(tok, text: str, rng: random.Random, count: int) -> list:
    """`count` tokens of the filler text from a random line start."""
    if count < 1:
        raise ValueError("--context is too short to hold the facts: raise it")
    start = text.find("\n", rng.randrange(len(text) // 2)) + 1
    ids = tok.encode(text[start:start + 8 * count])
    if len(ids) < count:
        raise ValueError(f"the filler text is too short for a {count}-token context")
    return ids[:count]


def run_recall(model: EvalModel, s: RecallSettings, progress: bool = True) -> EvalResult:
    """Exact-match accuracy of every task for full and every policy at every budget."""
    samples = make_samples(model.tokenizer, s)
    jobs = [("full", None, None)] + [(p, b, budget_tokens(b, s.context)) for b in s.budgets for p in s.policies]
    result = EvalResult("recall", s, machine=machine())
    lanes = [(policy, tokens) for policy, _, tokens in jobs]
    total = sum(len(x.prompt) + len(x.forced) for x in samples) * len(jobs)
    bar = progress_bar(total, "recall", progress)
    try:
        for task in s.tasks:
            hits = {lane: [] for lane in lanes}  # per lane, one (n, answer tokens) tensor per group
            for group in _by_length(samples, task):
                for lane, h in zip(lanes, _answer_hits(model, lanes, group)):
                    hits[lane].append(h)
            bar.update(len(jobs) * sum(len(x.prompt) + len(x.forced) for x in samples if x.task == task))
            for policy, spec, tokens in jobs:
                exact = torch.cat([h.all(-1) for h in hits[policy, tokens]])  # (samples,)
                right = torch.cat([h.flatten() for h in hits[policy, tokens]])  # every answer token of every sample
                result.rows.append({"policy": policy, "budget": spec or "all", "budget_tokens": tokens,
                                    "task": task, "exact_match": exact.float().mean().item(),
                                    "token_accuracy": right.float().mean().item(), "samples": len(exact)})
    finally:
        bar.close()
    return result


def _by_length(samples: list, task: str) -> list:
    """The task's samples grouped so that each group has one question length and one answer length."""
    groups: dict = {}
    for x in samples:
        if x.task == task:
            groups.setdefault((x.answer_start, len(x.forced)), []).append(x)
    return list(groups.values())


def _answer_hits(model: EvalModel, lanes: list, group: list) -> list:
    """Per lane (policy, budget tokens), bool (n, answer tokens): the argmax of each answer step is the answer
    token. Lanes of similar cache size share an engine pass (lane_passes, within auto_lane_mem), which prefills
    the group's prompts once for all of them."""
    forced = torch.tensor([x.forced for x in group])  # (n, steps)
    prompts = [x.prompt for x in group]
    prompt_len = max(map(len, prompts))
    hits = {}
    for part in lane_passes(model, lanes, prompt_len, forced.shape[1], len(group), auto_lane_mem()):
        for lane, (_, correct) in zip(part, lanes_run(model, part, prompts, forced)):
            hits[lane] = correct[:, group[0].answer_start:]
    return [hits[lane] for lane in lanes]


def format_recall(result: EvalResult, full_name: str = "full cache") -> str:
    """Markdown: one table per task, exact match (answer-token accuracy) per policy and budget (`full_name`: what
    the full run's cache was: eval.common.full_name)."""
    s, out = result.settings, []
    for task in s.tasks:
        rows = [r for r in result.rows if r["task"] == task]
        full = next(r for r in rows if r["policy"] == "full")
        head = [f"{b} ({budget_tokens(b, s.context)})" for b in s.budgets]
        out.append(f"{task}: exact match (answer-token accuracy), {full['samples']} samples, {s.context}-token "
                   f"context, {full_name} {_pct(full)}")
        out.append("| policy | " + " | ".join(head) + " |")
        out.append("|---|" + "---|" * len(head))
        for p in s.policies:
            cells = [_pct(next(r for r in rows if r["policy"] == p and r["budget"] == b)) for b in s.budgets]
            out.append(f"| {p} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def _pct(row: dict) -> str:
    return f"{row['exact_match'] * 100:.0f}% ({row['token_accuracy'] * 100:.0f}%)"
