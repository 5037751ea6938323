"""How a GPU batch's rows map to the rows computed: the one object generate() asks, at each compute op, which rows
to embed, how to prefill, how to run a decode step and which logits each row gets.

`BatchPlan` (the default) computes every row: its methods pass straight through to LayerCompute. `LanePlan` is
evaluation's: the GPU batch is `copies` copies of its first rows' prompts (eval's lanes, one copy per lane), so
prefill attends over one copy and every copy keeps its own tokens (attention.prefill); and in a LanePolicy batch,
lanes that equal a leader lane are not computed while they stay dormant (generation/followers.py). The engine holds
no branch of either: it calls the plan's methods through one interface.

A plan is made by the caller and started once per run (`start`), which checks it against the run and returns the
object the run calls (the plain plan: itself). A plan also says what the run's rows hold (`sequences`: the prompts,
left-padded), how many steps the schedule runs (`steps`) and how a compute op runs (`compute`): a row source whose
rows take queued requests as theirs finish (generation/refill.py's RefillPlan) is a plan too.
"""
from __future__ import annotations

import torch

from flexh2o.generation.sequences import Sequences


class BatchPlan:
    """Every row of a GPU batch is computed (the default plan; each method is a pass-through)."""

    def sequences(self, rc, cfg, prompts, gen_len: int, record_logits: bool):
        """The run's token state, made before `start`: the prompts left-padded (Sequences)."""
        return Sequences(prompts, rc.gpu_batch_size, rc.num_gpu_batches, gen_len, cfg.pad_token_id, cfg.vocab,
                         record_logits)

    def start(self, policy, rc, seqs, pipe) -> "BatchPlan":
        """The plan of one run: policy (the run's KV policy), rc (RunConfig), seqs (its Sequences), pipe (a
        pipeline stage's, or None)."""
        return self

    def steps(self, rc, gen_len: int) -> int:
        """The steps the schedule runs: one per generated token."""
        return gen_len

    def compute(self, run, op) -> None:
        """Compute op `op` of `run` (generation/run.Run) over the rows this plan computes."""
        run.compute_batch(op)

    def rows(self, step: int, ids: torch.Tensor, pos: torch.Tensor) -> tuple:
        """ids, pos (b, t) of the batch's rows at `step` -> those of the rows computed."""
        return ids, pos

    def prefill(self, layers, w: dict, cache_layer: int, x: torch.Tensor, pos: torch.Tensor) -> tuple:
        """LayerCompute.prefill of the computed rows -> (output, the block of every row of the batch)."""
        return layers.prefill(w, cache_layer, x, pos)

    def decode(self, layers, w: dict, cache_layer: int, x: torch.Tensor, pos: torch.Tensor, blk) -> torch.Tensor:
        """LayerCompute.decode of the computed rows against the batch's block `blk`."""
        return layers.decode(w, cache_layer, x, pos, blk)

    def logits(self, step: int, logits: torch.Tensor) -> torch.Tensor:
        """The head's logits of the computed rows -> (b, vocab), one per row of the batch."""
        return logits


class LanePlan(BatchPlan):
    """The GPU batch is `copies` copies of its first rows' prompts (one per lane of an evaluation pass): prefill
    computes one copy; with a LanePolicy, dormant follower lanes are not computed (generation/followers.py)."""

    def __init__(self, copies: int):
        if copies < 1:
            raise ValueError(f"prompt copies must be at least 1 (got {copies})")
        self.copies = copies

    def start(self, policy, rc, seqs, pipe):
        """Checks that every GPU batch really is `copies` copies of its first rows -> the run's plan (the plain
        plan for one copy)."""
        c = self.copies
        if c == 1:
            return BatchPlan()
        if rc.gpu_batch_size % c:
            raise ValueError(f"{c} prompt copies must divide the GPU batch of {rc.gpu_batch_size}")
        if pipe is not None:
            raise ValueError("prompt copies need the whole model in one process (no pipeline stages)")
        for x in (seqs.ids, seqs.pos):
            nb, b, t = x.shape
            if not torch.equal(x.view(nb, c, b // c, t), x[:, None, :b // c].expand(nb, c, b // c, t)):
                raise ValueError(f"{c} prompt copies: the GPU batch is not {c} copies of the same prompts")
        return _LaneRows(c, _followers(policy, rc, c))


def _followers(policy, rc, copies: int):
    """Followers for a batch of lanes in one GPU batch with an uncompressed cache and some lane that can follow
    another; None otherwise."""
    from flexh2o.generation.followers import Followers
    from flexh2o.kv.policies.lanes import LanePolicy
    if not isinstance(policy, LanePolicy) or rc.num_gpu_batches != 1 or rc.compress_cache is not None:
        return None
    followers = Followers(policy, rc.model.num_layers, copies)
    return followers if followers.able else None


class _LaneRows(BatchPlan):
    """One run of a LanePlan: prefill over one copy; decode steps over the rows up to the last lane not dormant."""

    def __init__(self, copies: int, followers):
        self.copies, self.followers = copies, followers

    def rows(self, step, ids, pos):
        if step == 0:  # prefill runs one copy of the prompts
            return ids[:len(ids) // self.copies], pos[:len(pos) // self.copies]
        if self.followers is None:
            return ids, pos
        active, _ = self.followers.advance(step, ids[:, 0].cpu(), pos[:, 0].cpu())  # once per step
        return ids[:active], pos[:active]

    def prefill(self, layers, w, cache_layer, x, pos):
        return layers.prefill_copies(w, cache_layer, x, pos, self.copies)

    def decode(self, layers, w, cache_layer, x, pos, blk):
        """The block's first `active` rows (the followers' plan of this step), the woken lanes' rows first copied
        from the leader's; the block remembers what to store home (every slot when a lane woke)."""
        active, woken = (len(x), []) if self.followers is None else self.followers.plan
        if active == blk.pos.shape[0] and not woken:
            return layers.decode(w, cache_layer, x, pos, blk)
        self.followers.wake(blk, woken)
        part = blk.rows(slice(0, active))
        lanes = self.followers.policy  # the active rows score for the dormant lanes that read scores
        x = layers.decode(w, cache_layer, x, pos, part, lanes.first_rows(active, scoring=lanes.needs_scores))
        if woken:
            blk.written = None  # rows were rewritten whole: the block goes home whole
        else:
            rest = part.written.new_zeros((blk.pos.shape[0] - active, *part.written.shape[1:]))
            blk.written = torch.cat([part.written, rest])  # dormant rows rewrite their slot 0, unchanged
        return x

    def logits(self, step, logits):
        if step == 0:  # every copy of a prompt has the logits of its one computed row
            return logits.repeat(self.copies, 1)
        alias = self.followers.alias(logits.device) if self.followers is not None else None
        return logits if alias is None else logits.index_select(0, alias)  # dormant rows: the leader's logits
