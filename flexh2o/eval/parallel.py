"""`flexh2o-eval ppl --procs N`: the texts split between N processes, each with its share of the torch threads.

One process with 2 threads keeps both cores busy only inside torch's parallel regions: between ops (the Python of a
decode step: ~30 layers of attention and policy work per token) the second core idles, and every region wakes the
passive OpenMP thread. N single-threaded processes on N cores have no such gaps. A text's windows are rows of their
own in a batch, so its figures do not depend on which other texts share the batch; the parent merges the rows back
into the order of one process's result.

Children are started with `spawn` (never fork a process whose OpenMP runtime is live); each sends its progress and
then its rows (or its error) through one queue.
"""
from __future__ import annotations

import multiprocessing as mp
import traceback
from dataclasses import replace

import torch

from flexh2o.eval.common import EvalModel, EvalResult, machine, progress_bar


def run_split(model: EvalModel, s, procs: int, progress: bool = True) -> EvalResult:
    """run_ppl of settings `s` with its texts dealt round-robin to min(procs, texts) processes."""
    from flexh2o.eval.ppl import _total_tokens
    groups = [s.texts[i::procs] for i in range(min(procs, len(s.texts)))]
    threads = max(1, torch.get_num_threads() // len(groups))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    children = [ctx.Process(target=_child, args=(i, model, replace(s, texts=tuple(g)), threads, queue), daemon=True)
                for i, g in enumerate(groups)]
    bar = progress_bar(_total_tokens(model, s), f"ppl ({len(groups)} processes)", progress)
    parts = {}
    try:
        for c in children:
            c.start()
        while len(parts) < len(children):
            kind, index, payload = queue.get()
            if kind == "tick":
                bar.update(payload)
            elif kind == "error":
                raise RuntimeError(f"ppl process {index} ({', '.join(groups[index])}) failed: {payload}")
            else:
                parts[index] = payload
    finally:
        bar.close()
        for c in children:
            if c.is_alive():
                c.terminate()
            c.join()
    return _merged(s, [parts[i] for i in range(len(groups))])


def _child(index: int, model: EvalModel, s, threads: int, queue) -> None:
    from flexh2o.eval.ppl import ppl_rows
    try:
        torch.set_num_threads(threads)
        rows = ppl_rows(model, s, lambda n: queue.put(("tick", index, n))).rows
        queue.put(("rows", index, rows))
    except BaseException as e:  # the parent names the failure in one line
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        queue.put(("error", index, last))


def _merged(s, parts: list) -> EvalResult:
    """One result from the processes' rows, ordered as one process orders them (lanes, then texts)."""
    rows = [r for part in parts for r in part]
    lanes = list(dict.fromkeys((r["policy"], r["budget"]) for r in parts[0]))
    rows.sort(key=lambda r: (lanes.index((r["policy"], r["budget"])), s.texts.index(r["text"])))
    result = EvalResult("ppl", s, machine=machine())
    result.rows = rows
    return result
