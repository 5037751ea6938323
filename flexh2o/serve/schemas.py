"""Request bodies of /v1/completions and /v1/chat/completions checked and turned into the engine's Requests as an
OpenAI batch line's body is (batch/openai_format.py: the batch format's fields max_tokens or max_completion_tokens,
temperature, top_p, top_k, stop, seed, n, model), plus stream and stream_options. Anything else is refused (400)
unless it asks for what the server does anyway (e.g. presence_penalty 0). A request beyond the plan's lengths (its
prompt over --prompt-len, or max_tokens over --gen-len) is refused too, so it can never break a running batch."""
from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from flexh2o.batch.openai_format import BODY_FIELDS, CHAT, COMPLETIONS, line_requests, parse_line
from flexh2o.requests import MAX_SEED, Defaults

STREAM = ("stream", "stream_options")
NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logprobs": (None, False),
           "echo": (False,), "best_of": (1,), "suffix": (None,), "logit_bias": (None, {}), "user": None,
           "top_logprobs": (None, 0), "parallel_tool_calls": (None, False), "tools": (None, [])}


class ApiError(Exception):
    """An HTTP error in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str = None, code: str = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str = None) -> ApiError:
    return ApiError(400, message, param)


@dataclass(frozen=True)
class Limits:
    """What the server's plan and model allow a request."""

    prompt_len: int
    gen_len: int
    positions: int
    vocab: int
    defaults: Defaults  # the run's temperature and top_p for fields left out


@dataclass(frozen=True)
class Parsed:
    """A checked body: its engine Requests (prompt-major, n per prompt), stream settings, stop strings."""

    requests: list
    stream: bool
    include_usage: bool
    stops: tuple
    n: int


def check_fields(body, chat: bool) -> None:
    if not isinstance(body, dict):
        raise bad("the request body is not a JSON object")
    allowed = BODY_FIELDS[CHAT if chat else COMPLETIONS] + STREAM
    for key, value in body.items():
        if key in allowed:
            continue
        if key in NEUTRAL and (NEUTRAL[key] is None or value in NEUTRAL[key]):
            continue
        raise bad(f"{key}: not supported by flexh2o-serve (it takes: {', '.join(allowed)})", key)


def stream_flags(body: dict) -> tuple:
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad("stream: give true or false", "stream")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage"}
                             or not isinstance(opts.get("include_usage", False), bool)):
        raise bad('stream_options: give {"include_usage": true or false}', "stream_options")
    if opts is not None and not stream:
        raise bad("stream_options: only with stream true", "stream_options")
    return bool(stream), bool((opts or {}).get("include_usage", False))


def stop_list(body: dict) -> tuple:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop: give a non-empty string or a list of them", "stop")
    return tuple(stop)


def make_requests(body: dict, chat: bool, limits: Limits, tokenizer, template, chat_stops=()) -> Parsed:
    """The body's engine Requests: n choices per prompt (a completion's prompt may be a list of prompts), built as
    an OpenAI batch line's are (batch/openai_format.py), then held to the plan's lengths."""
    stream, include_usage = stream_flags(body)
    url = CHAT if chat else COMPLETIONS
    core = {k: v for k, v in body.items() if k in BODY_FIELDS[url]}
    core.setdefault("seed", secrets.randbelow(MAX_SEED))  # unseeded sampling differs between requests and choices
    if chat and chat_stops:  # the template's end-of-turn markers that are no single token (those are EOS ids)
        core["stop"] = list(stop_list(core)) + [s for s in chat_stops if s not in stop_list(core)]
    prompts = [None] if chat else _prompts(core.get("prompt"))
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    out, n = [], 1
    try:
        for p in prompts:
            line = parse_line({"custom_id": "serve", "method": "POST", "url": url,
                               "body": core if chat else {**core, "prompt": p}})
            out += line_requests(line, 0, limits.defaults, limits.vocab, tokenizer, limits.positions, template)
            n = line.n
    except ValueError as e:
        msg = str(e).removeprefix("body.").replace("max_new_tokens", key).replace("prompt_ids", "prompt")
        raise bad(msg, re.match(r"[a-z_]*", msg).group() or None) from None
    for req in out[::n]:
        _fits(req, limits, key, "messages" if chat else "prompt")
    return Parsed(out, stream, include_usage, out[0].stop, n)


def _prompts(prompt) -> list:
    """A completion's prompts: one (a string or token ids), or a list of such."""
    many = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
    return prompt if many else [prompt]


def _fits(req, limits: Limits, key: str, prompt: str) -> None:
    if len(req.prompt_ids) > limits.prompt_len:
        raise bad(f"{prompt}: {len(req.prompt_ids)} tokens, more than the {limits.prompt_len} this server's plan "
                  "holds (its --prompt-len): shorten it", prompt)
    if req.max_new_tokens > limits.gen_len:
        raise bad(f"{key} {req.max_new_tokens}: more than the {limits.gen_len} this server's plan holds (its "
                  "--gen-len): lower it", key)
