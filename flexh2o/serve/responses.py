"""The chunks of a streamed answer: server-sent events of text_completion / chat.completion.chunk objects. A whole
answer's object is batch/openai_format.py's, as in an OpenAI batch file's output."""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

DONE = "data: [DONE]\n\n"


@dataclass
class Shape:
    """What differs between the two endpoints' chunks, and the id and time all chunks of one answer share."""

    chat: bool
    model: str
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)

    def choice(self, index: int, text: str, finish, first: bool = False) -> dict:
        """One choice's piece of text (a chat's first chunk names the role; its last may carry no text)."""
        if not self.chat:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}

    def chunk(self, choice: dict, with_usage: bool) -> str:
        obj = {**self._head(), "choices": [choice]}
        if with_usage:  # OpenAI's chunks then carry "usage": null until the last one
            obj["usage"] = None
        return sse(obj)

    def usage_chunk(self, usage: dict) -> str:
        return sse({**self._head(), "choices": [], "usage": usage})

    def _head(self) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
