"""Stop strings found incrementally: each step decodes only the last few tokens of a row, not its whole answer.

A row's text grows by the difference between two decodes that start at the same token (`prefix`): the tokens up to
`read` (decoded the step before) and every token. Starting both at the same token keeps what a decoder does at the
start of a text (a SentencePiece leading space, a continuation byte) out of the difference; a difference that ends
in U+FFFD (a UTF-8 character split across tokens) is not committed until the character is complete, but its
finished characters are searched at once (as a full decode would show them). A stop string can only newly appear
in the last len(new) + len(longest stop) - 1 characters, so only those are searched.
"""
from __future__ import annotations

SPLIT = "\ufffd"  # what a decoder shows for an incomplete UTF-8 sequence


class StopScan:
    """Per row: the committed text, and the token offsets of the next decode."""

    def __init__(self):
        self.text = ""
        self.prefix = 0  # first token of both decodes
        self.read = 0  # tokens already in `text`

    def found(self, tokenizer, tokens: list, stops: tuple) -> bool:
        """After appending the newest token to `tokens`: does the text now hold one of `stops`?"""
        before = tokenizer.decode(tokens[self.prefix:self.read]) if self.read > self.prefix else ""
        now = tokenizer.decode(tokens[self.prefix:])
        new = now[len(before):] if now.startswith(before) else None
        if new is None:  # the decoder changed earlier text (rare): fall back to the whole answer once
            self.text, new = "", tokenizer.decode(tokens)
        if new.endswith(SPLIT):  # an unfinished character: search what is finished, commit nothing yet
            return _holds(self.text, new.rstrip(SPLIT), stops)
        hit = _holds(self.text, new, stops)
        self.text += new
        self.prefix, self.read = self.read, len(tokens)
        return hit


def _holds(text: str, new: str, stops: tuple) -> bool:
    """Does text + new hold a stop string that ends inside `new`?"""
    if not new:
        return False
    longest = max(len(s) for s in stops)
    tail = text[len(text) - min(len(text), longest - 1):] + new
    return any(s in tail for s in stops)
