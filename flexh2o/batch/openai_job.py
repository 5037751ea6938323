"""An OpenAI batch file (batch/openai_format.py) as a request job: every line read and checked before anything runs
(a malformed one refuses the file, naming the line and the field), its requests run as a .jsonl job's do, and each
line answered by one output line once all its n choices have finished. A line this model cannot answer is answered
by an error line; the others still run. --resume skips the custom_ids already in the output."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

from flexh2o.batch import openai_format as fmt
from flexh2o.requests import fit_positions, json_lines


def is_openai_batch(path: str) -> bool:
    """Is the .jsonl file at `path` in the OpenAI batch format (its first line carries a custom_id)?"""
    try:
        with open(path, encoding="utf-8-sig") as f:
            first = next((line for line in f if line.strip()), "")
        obj = json.loads(first)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False  # the .jsonl reader says what is wrong with it
    return isinstance(obj, dict) and "custom_id" in obj


@dataclass(frozen=True)
class Record:
    """An output line, as batch/results.py's ResultWriter writes one."""

    line: dict

    def record(self) -> dict:
        return self.line


@dataclass
class OpenAIBatch:
    """The checked lines (by request id prefix 'L<num>'), their requests, and the lines that failed."""

    model: str
    lines: dict = field(default_factory=dict)  # "L<num>" -> BatchLine
    requests: list = field(default_factory=list)
    failed: list = field(default_factory=list)  # (custom_id, message)

    def todo(self, done: set) -> list:
        """The requests of the lines not yet answered (done: custom_ids in the output)."""
        return [r for r in self.requests if self.lines[_key(r.id)].custom_id not in done]

    def failed_lines(self, done: set) -> list:
        """Error output lines of the failed lines not yet in the output."""
        return [Record(fmt.error_line(cid, msg)) for cid, msg in self.failed if cid not in done]

    def collector(self, write: Callable) -> Callable:
        """on_result for run_requests: keeps each line's results until its n are in, then write(Record)."""
        got: dict = {}

        def on_result(result) -> None:
            key = _key(result.id)
            line = self.lines[key]
            choices = got.setdefault(key, [None] * line.n)
            choices[int(result.id.rsplit(".", 1)[1])] = result
            if all(c is not None for c in choices):
                write(Record(fmt.output_line(line, self.model, got.pop(key))))
        return on_result


def _key(request_id: str) -> str:
    return request_id.rsplit(".", 1)[0]


def load_openai_batch(path: str, defaults, vocab: int, tokenizer, positions: int, chat, model: str) -> OpenAIBatch:
    """Every line of an OpenAI batch file, checked: ValueError '--prompt-file PATH line N: FIELD: ...' at the first
    malformed line or repeated custom_id; a line this model cannot answer is kept in `failed`."""
    batch, seen = OpenAIBatch(model), {}
    for num, obj in json_lines(path):
        where = f"--prompt-file {path} line {num}"
        try:
            line = fmt.parse_line(obj)
            fmt.check_values(line, defaults, vocab, tokenizer)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if line.custom_id in seen:
            raise ValueError(f"{where}: custom_id {line.custom_id!r} repeats line {seen[line.custom_id]}; "
                             "custom_ids must be unique")
        seen[line.custom_id] = num
        try:
            reqs = fmt.line_requests(line, num, defaults, vocab, tokenizer, positions, chat)
        except ValueError as e:
            batch.failed.append((line.custom_id, str(e).replace("max_new_tokens", "max_tokens")))
            continue
        batch.lines[f"L{num}"] = line
        batch.requests += reqs
    if not seen:
        raise ValueError(f"--prompt-file {path} has no requests (one JSON object per line)")
    if batch.requests:
        try:
            fit_positions(batch.requests, positions, lambda r: f"line {_key(r.id)[1:]}")
        except ValueError as e:
            raise ValueError(f"--prompt-file {path}: {e}") from None
    return batch
