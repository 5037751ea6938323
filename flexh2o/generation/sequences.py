"""Per-sequence token state of one generate() call: left-padded prompts, emitted tokens, logits."""
from __future__ import annotations

from typing import Optional

import torch


class Sequences:
    """num_gpu_batches x gpu_batch_size sequences. ids/pos (nb, b, t): prompts left-padded to t (pos -1 on
    padding); tokens (nb, b, gen_len): what each step emitted; last_logits (nb, b, vocab): each batch's newest."""

    def __init__(self, prompts: list, gpu_batch_size: int, num_gpu_batches: int, gen_len: int, pad_id: int,
                 vocab: int, record_logits: bool = False):
        b, nb = gpu_batch_size, num_gpu_batches
        if len(prompts) != b * nb:
            raise ValueError(f"{len(prompts)} prompts given for {b} x {nb} sequences")
        if min(map(len, prompts)) < 1:
            raise ValueError("a prompt is empty: every prompt needs at least one token")
        self.t = t = max(len(p) for p in prompts)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        pos = torch.arange(t).view(1, t) - (t - lens).view(-1, 1)  # a prompt's tokens end at column t - 1
        real = pos >= 0
        ids = torch.full((b * nb, t), pad_id, dtype=torch.long)
        ids[real] = torch.tensor([tok for p in prompts for tok in p], dtype=torch.long)  # row-major: each row's
        pos = pos.masked_fill(~real, -1)  # real columns are its prompt in order
        self.ids, self.pos = ids.view(nb, b, t), pos.view(nb, b, t)
        self.lens = self.pos[:, :, -1] + 1  # (nb, b) real prompt lengths
        self.gen_len = gen_len
        self.tokens = torch.zeros(nb, b, gen_len, dtype=torch.long)
        self.vocab = vocab
        self._last: list = [None] * nb  # per GPU batch: its newest logits (b, vocab), fp32 on the CPU (`emit`)
        self._held: list = [None] * nb  # per GPU batch: the record logits of another dtype or device go into
        self.step_logits: Optional[list] = ([torch.zeros(nb, b, vocab) for _ in range(gen_len)] if record_logits
                                            else None)
        self._inputs: dict = {}  # (step, batch, device) -> (ids, pos) of the current step

    @property
    def last_logits(self) -> torch.Tensor:
        """(nb, b, vocab) fp32: each GPU batch's newest logits (zeros where none came: a stage without the head)."""
        b = self.tokens.shape[1]
        return torch.stack([x if x is not None else torch.zeros(b, self.vocab) for x in self._last])

    @property
    def num_batches(self) -> int:
        return self.tokens.shape[0]

    def inputs(self, step: int, batch: int, device) -> tuple:
        """(ids, pos) of one GPU batch for a step: the prompts at step 0, then the previous step's token. Built
        once per (step, batch) and handed to every layer (the previous step's token is final by then)."""
        key = (step, batch, str(device))
        if key not in self._inputs:
            if self._inputs and next(iter(self._inputs))[0] != step:
                self._inputs.clear()  # only the current step's are kept
            if step == 0:
                got = self.ids[batch].to(device), self.pos[batch].to(device)
            else:
                prev = self.tokens[batch, :, step - 1:step]
                got = prev.to(device), (self.lens[batch] + step - 1).view(-1, 1).to(device)
            self._inputs[key] = got
        return self._inputs[key]

    def emit(self, step: int, batch: int, logits: torch.Tensor, sampler) -> None:
        """Record a batch's logits (b, vocab) of `step` and the token the sampler picks from them: contiguous fp32
        logits on the CPU as the head made them (not copied), others converted into the batch's held fp32 record
        (converted into a fresh tensor, 16-bit logits paid a new mapping's page faults every step)."""
        if logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.is_contiguous():
            self._last[batch] = logits  # (b, vocab): the head's own output, read by nobody else after
        else:
            if self._held[batch] is None:
                self._held[batch] = torch.empty(logits.shape, dtype=torch.float32)
            self._last[batch] = self._held[batch].copy_(logits)  # (b, vocab) fp32 on the CPU
        logits = self._last[batch]
        if self.step_logits is not None:
            self.step_logits[step][batch] = logits
        b = self.tokens.shape[1]
        self.tokens[batch, :, step] = sampler(logits, step, slice(batch * b, (batch + 1) * b))

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        """(nb, b, ...) -> (num_seqs, ...)."""
        return x.reshape(-1, *x.shape[2:])
