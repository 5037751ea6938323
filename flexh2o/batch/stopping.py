"""When a row ends, and its result: at an EOS token (unless ignored), at a stop string, or at its max_new_tokens.

Token ids of a result include the token that ended it (the EOS token, or the one completing a stop string, as
transformers' generate() returns them); its text (when a tokenizer is known) leaves out special tokens and is cut
before the stop string.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

EOS, STOP, LENGTH = "eos", "stop", "length"


@dataclass(frozen=True)
class Result:
    """One finished request."""

    id: str
    text: Optional[str]
    token_ids: list
    finish_reason: str
    prompt_tokens: int
    generated_tokens: int

    def record(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StopRule:
    """The run's stopping facts: EOS ids (empty: never), and the tokenizer that decodes text (None: no text)."""

    eos_ids: frozenset = frozenset()
    tokenizer: object = None

    def reason(self, req, tokens: list, scan=None) -> Optional[str]:
        """Why a row whose generated tokens are `tokens` ends now (eos, stop, length), or None while it goes on.
        scan: the row's StopScan (batch/stop_scan.py), called once per new token: stop strings are then searched
        in the newest text only; None decodes the whole answer."""
        if tokens and tokens[-1] in self.eos_ids:
            return EOS
        if req.stop and (scan.found(self.tokenizer, tokens, req.stop) if scan is not None
                         else self._stop_at(req, tokens) is not None):
            return STOP
        if len(tokens) >= req.max_new_tokens:
            return LENGTH
        return None

    def _stop_at(self, req, tokens: list) -> Optional[int]:
        """Character offset of the first stop string in the decoded tokens, or None."""
        text = self.tokenizer.decode(tokens)
        hits = [i for i in (text.find(s) for s in req.stop) if i >= 0]
        return min(hits) if hits else None

    def result(self, req, tokens: list, reason: str) -> Result:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(tokens)
            if reason == STOP:
                text = text[:self._stop_at(req, tokens)]
        return Result(req.id, text, list(tokens), reason, len(req.prompt_ids), len(tokens))
