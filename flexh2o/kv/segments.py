"""The row segments of one decode attention: runs of consecutive rows of a block that read the same slots.

A batch's rows may use different numbers of slots (a refilled row, a row of a shorter prompt): attention reads each
run of rows up to its own last used slot, the runs merged down to MAX_SEGMENTS, or one call over every row when that
reads little more (ONE_CALL_SLACK). kv/attention.py's decode runs one attention call per segment.
"""
from __future__ import annotations

from typing import Optional

import torch

from flexh2o.kv.cache import row_extents

MAX_SEGMENTS = 8  # row segments of one decode attention; more runs are merged, the cheapest neighbours first
ONE_CALL_SLACK = 2.0  # one attention call over every row unless that reads over this many times the segments' slots


def used_segments(pos: torch.Tensor, extents: Optional[list] = None) -> list:
    """pos (b, kv, slots) -> [(first row, end row, slots used)]: runs of consecutive rows whose last used slot (over
    their KV heads) is the same, so attention reads no slot past it. More than MAX_SEGMENTS runs: neighbouring runs
    are merged (a merged run reads up to the larger of their extents), each time the pair whose merge adds the
    fewest slot reads (`merged_runs`). Off the CPU: one run over the whole block (reading the extents would make
    the host wait for the device). extents: row_extents(pos), when the caller has them."""
    b, slots = pos.shape[0], pos.shape[-1]
    if pos.device.type != "cpu":
        return [(0, b, slots)]
    used = row_extents(pos) if extents is None else extents  # (b,) slots in use up to the last used one
    return merged_runs(_runs(used), MAX_SEGMENTS)


def _runs(used: list) -> list:
    """Per-row extents -> [first row, end row, extent] runs of consecutive rows with the same extent."""
    runs = []
    for row, u in enumerate(used):
        if runs and runs[-1][2] == u:
            runs[-1][1] = row + 1
        else:
            runs.append([row, row + 1, u])
    return runs


def decode_segments(pos: torch.Tensor, extents: list) -> list:
    """one_call_or(used_segments(pos, extents)), with the one call tried on the rows' own runs first: merging runs
    only adds reads, so where one call holds against the runs it holds against the merged segments too, and the
    merge (a Python loop over the runs) is skipped."""
    if pos.device.type == "cpu":
        one = one_call_or(_runs(extents))
        if len(one) == 1:
            return [tuple(one[0])]
    return one_call_or(used_segments(pos, extents))


def one_call_or(segments: list) -> list:
    """The rows' segments, or one segment over every row up to the largest extent when that reads no more than
    ONE_CALL_SLACK times their slots: each further call costs about as much as a few hundred slot rows of small
    heads (a masked call of 12 rows x 320 slots took 0.31 ms against 1.17 ms in 8 segments, fp32, 2 threads), so
    the ragged rows of a refilled batch take one call while one long row among short ones keeps its own."""
    if len(segments) == 1:
        return segments
    top = max(u for _, _, u in segments)
    rows = segments[-1][1] - segments[0][0]
    reads = sum((r1 - r0) * u for r0, r1, u in segments)
    return [(segments[0][0], segments[-1][1], top)] if rows * top <= ONE_CALL_SLACK * reads else segments


def merged_runs(runs: list, most: int) -> list:
    """[first row, end row, slots] runs in row order -> at most `most` runs covering the same rows: the neighbouring
    pair whose merge adds the fewest slot reads ((rows) x (larger extent - own extent)) is merged first."""
    runs = [tuple(r) for r in runs]

    def extra(a, c):
        top = max(a[2], c[2])
        return (a[1] - a[0]) * (top - a[2]) + (c[1] - c[0]) * (top - c[2])

    while len(runs) > most:
        i = min(range(len(runs) - 1), key=lambda j: extra(runs[j], runs[j + 1]))
        a, c = runs[i], runs[i + 1]
        runs[i:i + 2] = [(a[0], c[1], max(a[2], c[2]))]
    return runs
