"""Prompt copies: the eval's lanes prefilled as `copies` copies of the same b prompts, one copy per lane (a LanePlan,
generation/batch_plan.py). Attention runs once over the b rows given (kv/prefill.py's attend) and every copy's rows
keep their own tokens under their own lane's policy, with the scores their own query weights give, computed once
per distinct weights; copy c of row r is row c * b + r of the block."""
from __future__ import annotations

import torch


class PromptCopies:
    def __init__(self, copies: int):
        self.copies = copies

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, ...) -> (copies * b, ...): every copy's rows, copy after copy."""
        return x.repeat(self.copies, *(1,) * (x.dim() - 1))

    def weights(self, policy, pos: torch.Tensor) -> tuple:
        """pos (b, t) -> (the distinct query weights (m, b, t) fp32 of the copies' rows under `policy`, index
        (copies,) of each copy's among them)."""
        b, t = pos.shape
        return distinct(policy.query_weights(self.rows(pos)).view(self.copies, b, t))

    def unscored(self, device) -> torch.Tensor:
        """The index of weights when none are computed: every copy reads the one (zero) score."""
        return torch.zeros(self.copies, dtype=torch.int64, device=device)

    def scores(self, score: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
        """score (m, b, kv, t) per distinct weights -> (copies * b, kv, t): each copy's rows with its own."""
        m, b, kv, t = score.shape
        return score[which].view(self.copies * b, kv, t)


def distinct(x: torch.Tensor) -> tuple:
    """x (copies, ...) -> (the distinct copies (m, ...), index (copies,) of each copy among them)."""
    if len(x) == 1:
        return x, torch.zeros(1, dtype=torch.int64, device=x.device)
    uniq, inverse = torch.unique(x.flatten(1), dim=0, return_inverse=True)
    return uniq.view(-1, *x.shape[1:]), inverse
