"""The results file of a batch job: one JSON line per finished request, appended as it finishes.

A line is written with one write() call and the file is flushed and fsynced once per step (`sync`), so a crash
leaves at most a torn last line. `done_ids` (for --resume) drops such a line, truncating the file to its last
complete line; a bad line before the last is corruption and refused.
"""
from __future__ import annotations

import json
import os


def done_ids(path: str, key: str = "id") -> set:
    """Ids already answered in `path` (none when it does not exist); a torn last line is cut off the file. key: the
    field holding a line's id ("custom_id" in the OpenAI batch format's output)."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    tail = lines.pop()  # after the last newline: empty, or a torn line
    ids, keep = set(), 0
    for num, line in enumerate(lines, 1):
        rec = _record(line, key)
        if rec is None:
            if num == len(lines) and not tail:  # the last line, complete but unreadable: torn too
                break
            raise ValueError(f"--output-file {path} line {num} is not a result line: the file is corrupt "
                             "(move it away to start over)")
        ids.add(rec[key])
        keep += len(line) + 1
    if keep != len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
            os.fsync(f.fileno())
    return ids


def _record(line: bytes, key: str):
    try:
        rec = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get(key), str) else None


class ResultWriter:
    """Appends result lines to `path`; `sync` flushes and fsyncs what was written since the last sync."""

    def __init__(self, path: str):
        self.f = open(path, "a", encoding="utf-8")
        self.dirty = False

    def write(self, result) -> None:
        self.f.write(json.dumps(result.record(), ensure_ascii=False) + "\n")
        self.dirty = True

    def sync(self) -> None:
        if self.dirty:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.dirty = False

    def close(self) -> None:
        self.sync()
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
