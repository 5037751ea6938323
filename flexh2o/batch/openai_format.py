"""The OpenAI batch format (as the OpenAI Batch API and `vllm run-batch` take it): input lines, output lines, and the
completion / chat.completion objects of their responses (the server builds its answers with the same functions).

An input line: {"custom_id": "...", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
"body": {...}}. Body fields: model (echoed), prompt (text or token ids; completions) or messages (chat), max_tokens
(chat: or max_completion_tokens), temperature, top_p, top_k, stop (a string or a list), seed, n. Fields left out
take the run's values, as a .jsonl request's do (requests.py). An output line: {"id", "custom_id", "response":
{"status_code": 200, "request_id", "body": <completion or chat.completion>}, "error": null}; a line the model cannot
answer (its prompt too long, no chat template, the template refusing the chat) gets "response": null and "error":
{"code", "message"}.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Optional

from flexh2o.chat import check_messages
from flexh2o.requests import MAX_SEED, request_from

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
LINE_FIELDS = ("custom_id", "method", "url", "body")
SAMPLING = ("model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n")
BODY_FIELDS = {COMPLETIONS: ("prompt",) + SAMPLING, CHAT: ("messages", "max_completion_tokens") + SAMPLING}
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # batch/stopping.py's reasons -> OpenAI's
MAX_N = 128


@dataclass(frozen=True)
class BatchLine:
    """One checked input line: its custom_id, url, body, and the request fields its body gives (requests.py's
    names) without the prompt."""

    custom_id: str
    url: str
    body: dict
    fields: tuple  # ((name, value), ...): max_new_tokens, temperature, top_p, top_k, stop, seed
    n: int = 1

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT

    @property
    def model(self) -> Optional[str]:
        return self.body.get("model")


def parse_line(obj) -> BatchLine:
    """A BatchLine from one JSON object; ValueError('FIELD: what is wrong') when the line is not one."""
    if not isinstance(obj, dict):
        raise ValueError("the line is not a JSON object: give {\"custom_id\", \"method\", \"url\", \"body\"}")
    unknown = sorted(set(obj) - set(LINE_FIELDS))
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown field (an OpenAI batch line has {', '.join(LINE_FIELDS)})")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise ValueError("custom_id: give a non-empty string")
    if obj.get("method") != "POST":
        raise ValueError(f"method {obj.get('method')!r}: give \"POST\"")
    url, body = obj.get("url"), obj.get("body")
    if url not in BODY_FIELDS:
        raise ValueError(f"url {url!r}: give {COMPLETIONS!r} or {CHAT!r}")
    if not isinstance(body, dict):
        raise ValueError("body: give a JSON object (the request's fields)")
    unknown = sorted(set(body) - set(BODY_FIELDS[url]))
    if unknown:
        raise ValueError(f"body.{unknown[0]}: not taken by {url} here (fields: {', '.join(BODY_FIELDS[url])})")
    prompt = "messages" if url == CHAT else "prompt"
    if prompt not in body:
        raise ValueError(f"body.{prompt}: missing ({url} needs it)")
    if "model" in body and not isinstance(body["model"], str):
        raise ValueError("body.model: give a string")
    if url == CHAT:
        try:
            check_messages(body["messages"])
        except ValueError as e:
            raise ValueError(f"body.{e}") from None
    return BatchLine(cid, url, body, _fields(body), _n(body))


def _fields(body: dict) -> tuple:
    """The body's sampling fields under requests.py's names (max_tokens -> max_new_tokens; stop as a list)."""
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise ValueError("body.max_completion_tokens: give it or max_tokens, not both")
    out = {k: body[k] for k in ("temperature", "top_p", "top_k", "seed") if body.get(k) is not None}
    most = body.get("max_completion_tokens", body.get("max_tokens"))
    if most is not None:
        out["max_new_tokens"] = most
    stop = body.get("stop")
    if stop is not None:
        out["stop"] = [stop] if isinstance(stop, str) else stop
    return tuple(out.items())


def _n(body: dict) -> int:
    n = body.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise ValueError(f"body.n {n!r}: give an integer in 1..{MAX_N}")
    return n


def check_values(line: BatchLine, defaults, vocab: int, tokenizer) -> None:
    """The body's sampling values checked on their own (a stand-in prompt): ValueError naming the body field."""
    try:
        request_from({"id": "x", "prompt_ids": [0], **dict(line.fields)}, defaults, vocab, tokenizer)
    except ValueError as e:
        raise ValueError("body." + str(e).replace("max_new_tokens", "max_tokens")) from None


def line_requests(line: BatchLine, num: int, defaults, vocab: int, tokenizer, positions: int, chat) -> list:
    """The line's n engine Requests, ids 'L<num>.<k>' (choice k samples with seed + k); ValueError when this model
    cannot answer it (the line then fails alone)."""
    prompt = _prompt_field(line)
    fields = dict(line.fields)
    out = []
    for k in range(line.n):
        seeded = {**fields, "seed": (fields["seed"] + k) % (MAX_SEED + 1)} if "seed" in fields and k else fields
        out.append(request_from({"id": f"L{num}.{k}", **prompt, **seeded}, defaults, vocab, tokenizer, positions,
                                chat))
    return out


def _prompt_field(line: BatchLine) -> dict:
    if line.is_chat:
        return {"messages": line.body["messages"]}
    p = line.body["prompt"]
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return {"prompt_ids": p}
    if not isinstance(p, str):
        raise ValueError("body.prompt: give a string or a list of token ids (one prompt a line)")
    return {"prompt": p}


def usage(prompt_tokens: int, results: list) -> dict:
    completion = sum(r.generated_tokens for r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def completion_object(model: str, results: list, prompt_tokens: int, created: Optional[int] = None) -> dict:
    """A `text_completion` object (openai.types.Completion) of a prompt's results, choice i = results[i]."""
    choices = [{"index": i, "text": r.text or "", "finish_reason": FINISH[r.finish_reason], "logprobs": None}
               for i, r in enumerate(results)]
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": created or int(time.time()),
            "model": model, "choices": choices, "usage": usage(prompt_tokens, results)}


def chat_completion_object(model: str, results: list, prompt_tokens: int, created: Optional[int] = None) -> dict:
    """A `chat.completion` object (openai.types.chat.ChatCompletion) of a chat's results, choice i = results[i]."""
    choices = [{"index": i, "message": {"role": "assistant", "content": r.text or ""},
                "finish_reason": FINISH[r.finish_reason], "logprobs": None} for i, r in enumerate(results)]
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": created or int(time.time()),
            "model": model, "choices": choices, "usage": usage(prompt_tokens, results)}


def output_line(line: BatchLine, model: str, results: list) -> dict:
    """The output line answering `line` with its n results (in choice order)."""
    make = chat_completion_object if line.is_chat else completion_object
    body = make(line.model or model, results, results[0].prompt_tokens)
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": 200, "request_id": f"req_{uuid.uuid4().hex}", "body": body}, "error": None}


def error_line(custom_id: str, message: str, code: str = "invalid_request") -> dict:
    """The output line of a line that failed: no response, the error's code and one-line message."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}
