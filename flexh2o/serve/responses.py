"""The OpenAI response objects: text_completion and chat.completion, whole or as server-sent-event chunks."""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # batch/stopping.py's reasons -> OpenAI's


@dataclass
class Shape:
    """What differs between the two endpoints' objects, and the id and time shared by all chunks of one answer."""

    chat: bool
    model: str
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def choice(self, index: int, text: str, finish, chunk: bool, first: bool = False) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        if chunk:
            delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}

    def whole(self, choices: list, usage: dict) -> dict:
        """choices: [(text, finish_reason)] in index order."""
        return {**self._head(False), "choices": [self.choice(i, t, f, False) for i, (t, f) in enumerate(choices)],
                "usage": usage}

    def chunk(self, choice: dict, with_usage: bool) -> str:
        obj = {**self._head(True), "choices": [choice]}
        if with_usage:
            obj["usage"] = None
        return sse(obj)

    def usage_chunk(self, usage: dict) -> str:
        return sse({**self._head(True), "choices": [], "usage": usage})


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
