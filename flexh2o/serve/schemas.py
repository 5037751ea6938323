"""Request bodies of /v1/completions and /v1/chat/completions checked and turned into the engine's Requests, with
the same sampling fields as a batch job's lines (requests.py): max_tokens (chat: or max_completion_tokens),
temperature, top_p, stop, seed, n; plus model, stream and stream_options. Anything else is refused (400) unless
it asks for what the server does anyway (e.g. presence_penalty 0). A request beyond the plan's lengths (its prompt
over --prompt-len, or max_tokens over --gen-len) is refused too, so it can never break a running batch."""
from __future__ import annotations

import secrets
from dataclasses import dataclass

from flexh2o.requests import MAX_SEED, Defaults, request_from

SAMPLING = ("max_tokens", "temperature", "top_p", "stop", "seed", "n")
COMMON = ("model", "stream", "stream_options") + SAMPLING
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


def check_fields(body, allowed: tuple) -> None:
    if not isinstance(body, dict):
        raise bad("the request body is not a JSON object")
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


def _int_field(body: dict, key: str, low: int):
    value = body.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
        raise bad(f"{key} {value!r}: give an integer >= {low}", key)
    return value


def stop_list(body: dict) -> tuple:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop: give a non-empty string or a list of them", "stop")
    return tuple(stop)


def make_requests(prompts: list, body: dict, limits: Limits, tokenizer, max_key: str, extra_stops=()) -> Parsed:
    """prompts: token-id lists. The body's sampling fields (checked) for each of n choices of each prompt."""
    stream, include_usage = stream_flags(body)
    n = _int_field(body, "n", 1) or 1
    max_tokens = _int_field(body, max_key, 1)
    stops = stop_list(body) + tuple(s for s in extra_stops if s not in stop_list(body))
    seed = _int_field(body, "seed", 0)
    out = []
    for ids in prompts:
        if len(ids) > limits.prompt_len:
            raise bad(f"prompt: {len(ids)} tokens, more than the {limits.prompt_len} this server's plan holds "
                      "(its --prompt-len): shorten the prompt", "prompt")
        room = min(limits.gen_len, limits.positions - len(ids))
        if max_tokens is not None and max_tokens > limits.gen_len:
            raise bad(f"{max_key} {max_tokens}: more than the {limits.gen_len} this server's plan holds (its "
                      f"--gen-len): lower it", max_key)
        for i in range(n):
            fields = {"max_new_tokens": max_tokens or max(room, 1), "stop": list(stops),
                      "seed": (seed + i) % (MAX_SEED + 1) if seed is not None else secrets.randbelow(MAX_SEED)}
            fields.update({k: body[k] for k in ("temperature", "top_p") if body.get(k) is not None})
            try:
                out.append(request_from({"id": secrets.token_hex(8), "prompt_ids": list(ids), **fields},
                                        limits.defaults, limits.vocab, tokenizer if stops else None,
                                        limits.positions))
            except ValueError as e:
                raise bad(str(e).replace("max_new_tokens", max_key).replace("prompt_ids", "prompt")) from None
    return Parsed(out, stream, include_usage, stops, n)


def completion_prompts(body: dict, tokenizer, vocab: int) -> list:
    """/v1/completions' prompt: a string, a list of token ids, or a list of either; as token-id lists."""
    prompt = body.get("prompt")
    many = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
    items = prompt if many else [prompt]
    return [_prompt_ids(p, tokenizer, vocab) for p in items]


def _prompt_ids(p, tokenizer, vocab: int) -> list:
    if isinstance(p, str) and p:
        if tokenizer is None:
            raise bad("prompt: text needs the model's tokenizer: start the server with --tokenizer, or send token "
                      "ids", "prompt")
        ids = tokenizer.encode(p)
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        ids = p
    else:
        raise bad("prompt: give a non-empty string, a list of token ids, or a list of those", "prompt")
    if not ids or not all(0 <= t < vocab for t in ids):
        raise bad(f"prompt: token ids must lie in 0..{vocab - 1} (and a text must encode to some)", "prompt")
    return list(ids)


def chat_prompt(body: dict, template, tokenizer) -> list:
    """/v1/chat/completions' messages rendered by the model's chat template, as token ids."""
    if template is None or tokenizer is None:
        raise bad("messages: this model has no chat template (or no tokenizer): use /v1/completions", "messages")
    try:
        text = template.render(body.get("messages"), add_generation_prompt=True)
    except ValueError as e:
        raise bad(str(e), "messages") from None
    ids = tokenizer.encode(text, bos=False)  # the template writes its own BOS text, as transformers renders it
    if not ids:
        raise bad("messages: the rendered conversation encodes to no tokens", "messages")
    return ids
