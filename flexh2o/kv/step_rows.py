"""One decode step's rows when no token was ever evicted (row i holds its positions 0..at[i] in slots 0..at[i]): the
positions as a list and their extents, and a place where what every layer of the step derives from them (a ragged
batch's attention segments and masks, the flat index its new tokens are written through) is made once a step rather
than once a layer. LayerCompute makes one per decode step (generation/compute.py); attention.decode makes its own
when the caller has none."""
from __future__ import annotations

from typing import Callable


class StepRows:
    def __init__(self, at: list):
        self.at = at  # per row, the position of the token this step writes (its slot too)
        self.extents = [p + 1 for p in at]  # per row, its slots in use once the token is written
        self._made: dict = {}

    def made(self, key, make: Callable):
        """make()'s value, made on the first call with `key` this step (the key names everything it depends on
        beyond the rows' positions: a block's shape, a device)."""
        got = self._made.get(key)
        if got is None:
            got = self._made[key] = make()
        return got
