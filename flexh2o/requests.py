"""Requests of a batch job: one per line of a `.jsonl` prompt file (or one per prompt of the older formats).

A line is a JSON object: `id` (a unique string), `prompt` (text, encoded with the model's tokenizer), `prompt_ids`
(token ids) or `messages` (a chat, rendered with the model's chat template: chat.py), and optional `max_new_tokens`,
`stop` (strings), `temperature`, `top_p`, `top_k`, `seed`. Fields left out take the run's values (--gen-len,
--temperature, --top-p, --top-k, --seed). Every line is checked before anything
runs; a bad one is one ValueError naming the file, the line number and the field.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Optional

FIELDS = ("id", "prompt", "prompt_ids", "messages", "max_new_tokens", "stop", "temperature", "top_p", "top_k", "seed")
PROMPTS = ("prompt", "prompt_ids", "messages")
MAX_SEED = (1 << 63) - 1  # torch.Generator.manual_seed takes a 64-bit value


@dataclass(frozen=True)
class Defaults:
    """The run's values for what a request leaves out."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0


@dataclass(frozen=True)
class Request:
    """One prompt to answer. prompt_ids: its tokens; text: the prompt as given (None for token ids; a chat's
    rendered prompt); top_k: sample from the k most likely tokens (0: all)."""

    id: str
    prompt_ids: tuple
    max_new_tokens: int = 32
    stop: tuple = ()
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    text: Optional[str] = field(default=None, compare=False)
    top_k: int = 0

    def __post_init__(self):
        if not isinstance(self.id, str) or not self.id:
            raise ValueError("id: give a non-empty string")
        if not self.prompt_ids or not all(_is_int(t) and t >= 0 for t in self.prompt_ids):
            raise ValueError("prompt_ids: give a non-empty list of token ids (integers >= 0)")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {self.max_new_tokens!r}: give an integer >= 1")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop: give a list of non-empty strings")
        if not (_is_num(self.temperature) and 0 <= self.temperature < math.inf):
            raise ValueError(f"temperature {self.temperature!r}: give a finite number >= 0 (0 is greedy)")
        if not (_is_num(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p {self.top_p!r}: give a number in (0, 1]")
        if not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed {self.seed!r}: give an integer in 0..{MAX_SEED}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k {self.top_k!r}: give an integer >= 0 (0: every token)")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def request_from(obj: dict, defaults: Defaults, vocab: int, tokenizer=None, positions: Optional[int] = None,
                 chat=None) -> Request:
    """A Request from one JSON object; ValueError('FIELD: what is wrong') when it cannot be one (positions: the
    model's, which its prompt and max_new_tokens may not exceed together; chat: the model's ChatTemplate, which
    `messages` needs)."""
    req = _request(obj, defaults, vocab, tokenizer, chat)
    if positions is not None and len(req.prompt_ids) + req.max_new_tokens > positions:
        raise ValueError(f"max_new_tokens {req.max_new_tokens}: with the prompt's {len(req.prompt_ids)} tokens it "
                         f"exceeds the model's {positions} positions: shorten the prompt or lower max_new_tokens")
    return req


def fit_positions(reqs: list, positions: int, name=lambda r: f"id {r.id!r}") -> None:
    """Every row of a job is planned for its longest prompt plus its largest max_new_tokens: ValueError when those
    two, of different requests, exceed the model's positions (each request within them is checked by request_from)."""
    longest = max(reqs, key=lambda r: len(r.prompt_ids))
    most = max(reqs, key=lambda r: r.max_new_tokens)
    if len(longest.prompt_ids) + most.max_new_tokens > positions:
        raise ValueError(f"the longest prompt ({len(longest.prompt_ids)} tokens, {name(longest)}) + the largest "
                         f"max_new_tokens ({most.max_new_tokens}, {name(most)}) exceed the model's {positions} "
                         "positions, and every row is planned for both: run such requests in separate jobs")


def _request(obj: dict, defaults: Defaults, vocab: int, tokenizer, chat=None) -> Request:
    if not isinstance(obj, dict):
        raise ValueError("the line is not a JSON object: give {\"id\": ..., \"prompt\": ...}")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown field (fields: {', '.join(FIELDS)})")
    if "id" not in obj:
        raise ValueError("id: missing (every request needs a unique string id)")
    ids, text = _prompt_ids(obj, vocab, tokenizer, chat)
    stop = obj.get("stop", [])
    if isinstance(stop, str) or not isinstance(stop, list):
        raise ValueError("stop: give a list of strings")
    if stop and tokenizer is None:
        raise ValueError("stop: stop strings need the model's tokenizer (--tokenizer)")
    try:
        req = Request(obj["id"], tuple(ids), obj.get("max_new_tokens", defaults.max_new_tokens), tuple(stop),
                      obj.get("temperature", defaults.temperature), obj.get("top_p", defaults.top_p),
                      obj.get("seed", defaults.seed), text, obj.get("top_k", defaults.top_k))
    except TypeError:
        raise ValueError("stop: give a list of strings") from None
    for name, unused in (("top_p", req.top_p < 1), ("top_k", req.top_k > 0)):
        if name in obj and unused and req.temperature == 0:
            raise ValueError(f"{name} {obj[name]}: this request decodes greedily (temperature 0), which reads no "
                             f"{name}: give it a temperature > 0, or drop {name}")
    return req


def check_top_p(top_p: float, temperatures, flag: str = "--top-p") -> None:
    """A run's top_p below 1 when every row decodes greedily (all `temperatures` 0) would be ignored: ValueError
    naming the flag and the fix."""
    if top_p < 1 and all(t == 0 for t in temperatures):
        raise ValueError(f"{flag} {top_p} is unused: every row decodes greedily (temperature 0), which reads no "
                         f"top-p: give a temperature > 0 (the run's or a request's), or drop {flag}")


def check_sampling(top_p: float, top_k: int, temperatures, names=("--top-p", "--top-k")) -> None:
    """check_top_p and check_top_k of a run's values (names: their flags, or the API's keywords)."""
    check_top_p(top_p, temperatures, names[0])
    check_top_k(top_k, temperatures, names[1])


def check_top_k(top_k: int, temperatures, flag: str = "--top-k") -> None:
    """A run's top_k when every row decodes greedily would be ignored: ValueError naming the flag and the fix."""
    if top_k > 0 and all(t == 0 for t in temperatures):
        raise ValueError(f"{flag} {top_k} is unused: every row decodes greedily (temperature 0), which reads no "
                         f"top-k: give a temperature > 0 (the run's or a request's), or drop {flag}")


def _prompt_ids(obj: dict, vocab: int, tokenizer, chat=None) -> tuple:
    """(token ids, text or None) of a request's prompt."""
    if sum(k in obj for k in PROMPTS) != 1:
        raise ValueError("prompt: give exactly one of prompt (text), prompt_ids (token ids) and messages (a chat)")
    if "messages" in obj:
        return _chat_ids(obj["messages"], vocab, tokenizer, chat)
    if "prompt_ids" in obj:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids):
            raise ValueError("prompt_ids: give a non-empty list of integer token ids")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_ids: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return ids, None
    text = obj["prompt"]
    if not isinstance(text, str) or not text:
        raise ValueError("prompt: give a non-empty string")
    if tokenizer is None:
        raise ValueError("prompt: text needs the model's tokenizer (--tokenizer), or give prompt_ids")
    ids = tokenizer.encode(text)
    if not ids:
        raise ValueError("prompt: encodes to no tokens")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt: encodes to token id {bad[0]}, outside the model's vocabulary (0..{vocab - 1}): "
                         "pass the --tokenizer of this model")
    return ids, text


def _chat_ids(messages, vocab: int, tokenizer, chat) -> tuple:
    """(token ids, rendered prompt) of a chat: the template writes any BOS itself, so none is added."""
    if chat is None:
        raise ValueError("messages: this model has no chat template (none in its .gguf, tokenizer_config.json or "
                         "chat_template.jinja): give prompt text instead")
    if tokenizer is None:
        raise ValueError("messages: a chat needs the model's tokenizer (--tokenizer)")
    text = chat.render(messages, add_generation_prompt=True)
    ids = tokenizer.encode(text, bos=False)
    if not ids:
        raise ValueError("messages: the chat template renders them to no tokens")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"messages: the chat encodes to token id {bad[0]}, outside the model's vocabulary "
                         f"(0..{vocab - 1}): pass the --tokenizer of this model")
    return ids, text


def json_lines(path: str):
    """(line number, JSON value) of every non-empty line of a --prompt-file; ValueError naming the file and line."""
    try:
        with open(path, encoding="utf-8-sig") as f:  # a byte-order mark (Notepad's) is no text
            lines = f.read().split("\n")
    except OSError as e:
        raise ValueError(f"--prompt-file {path} cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file {path} is not UTF-8 text (offset {e.start}): save it as UTF-8") from None
    for num, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield num, json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompt-file {path} line {num}: not valid JSON ({e.msg} at column {e.colno})") from None


def load_requests(path: str, defaults: Defaults, vocab: int, tokenizer=None, positions: Optional[int] = None,
                  chat=None) -> list:
    """Every request of a .jsonl file, checked: ValueError '{path} line N: FIELD: ...' at the first bad line;
    positions: the model's (a request past them, or a job whose rows would be, is refused)."""
    out, seen = [], {}
    for num, obj in json_lines(path):
        try:
            req = request_from(obj, defaults, vocab, tokenizer, positions, chat)
        except ValueError as e:
            raise ValueError(f"--prompt-file {path} line {num}: {e}") from None
        if req.id in seen:
            raise ValueError(f"--prompt-file {path} line {num}: id: {req.id!r} repeats line {seen[req.id]}; "
                             "ids must be unique")
        seen[req.id] = num
        out.append(req)
    if not out:
        raise ValueError(f"--prompt-file {path} has no requests (one JSON object per line)")
    if positions is not None:
        try:
            fit_positions(out, positions, lambda r: f"line {seen[r.id]}")
        except ValueError as e:
            raise ValueError(f"--prompt-file {path}: {e}") from None
    return out


def requests_from_prompts(prompts: list, defaults: Defaults) -> list:
    """The older prompt formats (token-id lists): request ids are the prompts' indices ('0', '1', ...)."""
    return [Request(str(i), tuple(p), defaults.max_new_tokens, (), defaults.temperature, defaults.top_p,
                    defaults.seed, top_k=defaults.top_k) for i, p in enumerate(prompts)]
