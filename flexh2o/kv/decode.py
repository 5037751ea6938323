"""One decode step over a KV block, in three stages: append the new token, attend, evict (kv/attention.py's decode).

Which way each stage goes is a `DecodePath`, chosen once per run and layer shape (generation/compute.py's
LayerCompute makes one per decoder layer): whether the rows hold their tokens in order (no token is ever dropped:
the free slot and extents come from the positions, not searched), whether probabilities are materialised (the
policy scores tokens, logits are soft-capped or the block is quantized) and which reader takes a quantized block's
levels (compress/fused_attend.py's, chosen once a process; where the fused reader runs, the default scheme's block
is read in one compiled call, compress/fused_decode.py; where its rows are in order too, the append is in that call:
`DecodePath._in_one_call`).

Attention runs on the block's device, each segment of rows over the slots its rows use (kv/segments.py: empty slots
past the last used one are skipped, not just masked, unless one masked call over every row reads little more); the
scores are updated and at most one token per row is evicted (its slot is free for the next step). The policy sees
the block's slots up to the last one any row uses (`KVBlock.front`). A windowed layer drops the token the next query
will not see before the policy chooses (the block holds window - 1 tokens at most between steps).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from flexh2o.compress import fused_attend, fused_decode, fused_step
from flexh2o.compress.form import Plain, as_form
from flexh2o.compress.rotation import rotated_if, unrotated_if
from flexh2o.kv.cache import KVBlock, row_extents
from flexh2o.kv.policies.base import KVPolicy, Observed
from flexh2o.kv.sdpa import capped, sdpa
from flexh2o.kv.segments import decode_segments
from flexh2o.kv.step_rows import StepRows
from flexh2o.tensors import moved


@dataclass(frozen=True)
class DecodePath:
    """A layer's decode step (module docstring). window, softcap: the layer's (ModelConfig); in_order: nothing is
    ever dropped (the run evicts nothing, LayerCompute.evicts, and the layer has no window); read: how a quantized
    block's levels are read (None: the block is plain, so a policy that scores nothing runs the fused kernel)."""

    window: Optional[int] = None
    softcap: Optional[float] = None
    in_order: bool = False
    read: Optional[fused_attend.Reader] = None

    @staticmethod
    def of(window: Optional[int], softcap: Optional[float], evicts: bool, quantized: bool) -> "DecodePath":
        """The path of a layer of these facts (the reader chosen once a process: fused_attend.reader)."""
        return DecodePath(window, softcap, not evicts and window is None,
                          fused_attend.reader() if quantized else None)

    def __call__(self, q, k, v, cur_pos, blk: KVBlock, policy: KVPolicy, layer: int,
                 at: Optional[StepRows] = None) -> torch.Tensor:
        """One new token. q (b, n, 1, d), k/v (b, kv, 1, d), cur_pos (b,) -> out (b, n, 1, d). at: the step's
        kv/step_rows.StepRows, when the caller has one (in order: what the step's layers share is made there once);
        without one, in order is read from cur_pos on the CPU only (off it, reading it would make the host wait)."""
        dev, home = blk.pos.device, q.device
        q, k, v, cur_pos = moved(q, dev), moved(k, dev), moved(v, dev), moved(cur_pos, dev)
        b, n, _, d = q.shape
        step = self.step_rows(cur_pos, at)
        qg = q.view(b, blk.pos.shape[1], n // blk.pos.shape[1], d)
        out = self._in_one_call(qg, k, v, cur_pos, blk, policy, layer, step)
        if out is not None:  # written and read in one call
            return moved(out.reshape(b, n, 1, d), home)
        append(blk, k, v, cur_pos, step)
        extents = step.extents if step is not None else row_extents(blk.pos)  # per row, up to its last used slot
        segments = (step.made(("segments", b, blk.pos.shape[-1], str(dev)), lambda: decode_segments(blk.pos, extents))
                    if step is not None else decode_segments(blk.pos, extents))
        top = max(u for _, _, u in segments)  # slots past every row's last used one are never read: not expanded
        fused = self.read is None and not policy.needs_scores and self.softcap is None
        if fused and step is not None:  # nothing to score or evict: the fused kernel over the block's own slots
            return moved(_fused_in_place(qg, blk, top, segments, step).reshape(b, n, 1, d), home)
        front = blk.front(top)  # all the step reads and the policy sees
        out = (_fused_front(qg, front, segments) if fused
               else _scored(qg, front, policy, segments, self.softcap, self.read or fused_attend.PLAIN))
        self.evict(blk, front, policy, layer, cur_pos, extents)
        return moved(out.reshape(b, n, 1, d), home)

    def _in_one_call(self, qg, k, v, cur_pos, blk: KVBlock, policy: KVPolicy, layer: int,
                     step: Optional[StepRows]) -> Optional[torch.Tensor]:
        """A quantized block whose rows hold their tokens in order: the new token written and the attention read in
        one compiled call (compress/fused_decode.py's step_attend: each (row, head) pair's write, then its read, on
        one thread of the pool) where both one-call kernels take the block and one segment reads every row; the
        policy's scores and eviction as after _scored. -> qg's output, or None (nothing written)."""
        if self.read is None or self.read.kernels is None or step is None or fused_decode.kernel() is None:
            return None
        segments = step.made(("segments", qg.shape[0], blk.pos.shape[-1], str(blk.pos.device)),
                             lambda: decode_segments(blk.pos, step.extents))  # from the extents: the rows in order
        wk = fused_step.kernel()
        found = fused_step.parts(blk.k, blk.v, blk.pos, blk.score) if wk is not None and len(segments) == 1 else None
        keys, values = (as_form(x).front(segments[0][2]) for x in (blk.k, blk.v))
        if found is None or not fused_decode.fits(keys, values, qg):
            return None
        write, blk.written = fused_step.write_args(found, blk.pos, blk.score, k[:, :, 0], v[:, :, 0], cur_pos, True)
        front = blk.front(segments[0][2])
        out, att_sum = fused_decode.step_attend(fused_decode.kernel(), write, qg, keys, values, front.pos, self.softcap,
                                                policy.needs_scores)
        if policy.needs_scores:
            policy.accumulate(front.score, att_sum)
        self.evict(blk, front, policy, layer, cur_pos, step.extents)
        return out

    def step_rows(self, cur_pos: torch.Tensor, at: Optional[StepRows]) -> Optional[StepRows]:
        """The step's rows when they hold their tokens in order (`at`, or made here on the CPU), else None."""
        if not self.in_order or (at is None and cur_pos.device.type != "cpu"):
            return None
        return StepRows(cur_pos.tolist()) if at is None else at

    def evict(self, blk: KVBlock, front: KVBlock, policy: KVPolicy, layer: int, cur_pos, extents: list) -> None:
        """After the attention: a windowed layer drops what the next query cannot see; the policy evicts at most
        one token per row (merging its value into a kept one when it merges), reading what the block holds."""
        if self.window is not None:
            front.evict((front.pos >= 0) & (front.pos <= (cur_pos + 1 - self.window).view(-1, 1, 1)))
        values = as_form(front.v).expanded(torch.float32) if policy.needs_values else None
        keys32 = as_form(front.k).expanded(torch.float32) if policy.needs_keys or policy.merges else None
        evict = policy.decode_evict(front.pos, front.score, layer, cur_pos, extents=extents,
                                    obs=Observed(keys32, values).only(policy))
        if policy.merges and evict is not None:
            front.merge(*policy.merge_plan(front.pos, front.score, keys32, evict, extents=extents))
            blk.written = front.written
        front.evict(evict)


def append(blk: KVBlock, k, v, cur_pos, step: Optional[StepRows]) -> torch.Tensor:
    """The new K/V (b, kv, 1, d) into each row's free slot, in place (the block remembers the slot): in order, the
    slot is the position (step's list), else the first free one."""
    in_order = step is not None
    return blk.append(k[:, :, 0], v[:, :, 0], cur_pos, in_order, step.at if in_order else None, step)


def _fused_in_place(qg, blk: KVBlock, top: int, segments: list, step: StepRows) -> torch.Tensor:
    """A plain block in order whose policy scores nothing: the fused kernel over its first `top` slots, read as
    stored (expanded only when stored in another dtype)."""
    (keys, rk), (values, rv) = (as_form(x).expanded_stored(qg.dtype) for x in blk.front_kv(top))
    out = _fused(rotated_if(qg, rk), keys, values, blk.pos, segments, step)
    return unrotated_if(out, rv)


def _fused_front(qg, front: KVBlock, segments: list) -> torch.Tensor:
    """A plain block whose policy scores nothing, out of order: the fused kernel per segment over `front`."""
    (keys, rk), (values, rv) = (as_form(x).expanded_stored(qg.dtype) for x in (front.k, front.v))
    return unrotated_if(_fused(rotated_if(qg, rk), keys, values, front.pos, segments, None), rv)


def _fused(qg, keys, values, pos, segments: list, step: Optional[StepRows]) -> torch.Tensor:
    """The fused kernel over each segment of rows, the query heads of a KV head as rows: qg (b, kv, g, d),
    keys/values (b, kv, top, d), pos (b, kv, >= top) -> (b, kv, g, d). step (in order): a segment whose every row
    fills its slots runs unmasked, another is masked from the extents (one mask for every head, pos not read, made
    once a step); one segment of such rows is the kernel's own output."""
    def keep(r0, r1, used):  # each row holds its new token, so no row of the mask is empty
        if step is None:
            return (pos[r0:r1, :, :used] >= 0)[:, :, None]
        if min(step.extents[r0:r1]) == used:
            return None
        return step.made(("mask", r0, r1, used, str(pos.device)), lambda: _extent_mask(step, r0, r1, used, pos.device))
    if len(segments) == 1:  # used: every slot of keys (KVBlock.front_kv cut them there)
        return sdpa(qg, keys, values, attn_mask=keep(*segments[0]))
    out = torch.empty(qg.shape, dtype=qg.dtype, device=qg.device)
    for r0, r1, used in segments:
        out[r0:r1] = sdpa(qg[r0:r1], keys[r0:r1, :, :used], values[r0:r1, :, :used], attn_mask=keep(r0, r1, used))
    return out


def _extent_mask(step: StepRows, r0: int, r1: int, used: int, device) -> torch.Tensor:
    """(rows, 1, 1, used) bool, every head: in order, slot i of a row is used iff i < its extent."""
    ext = torch.tensor(step.extents[r0:r1], device=device).view(-1, 1)
    return (torch.arange(used, device=device) < ext)[:, None, None]


def _scored(qg, front: KVBlock, policy: KVPolicy, segments: list, softcap, read: fused_attend.Reader) -> torch.Tensor:
    """Attention with its probabilities materialised (fp32), per segment: qg (b, kv, g, d) -> (b, kv, g, d), in the
    model's basis; the policy accumulates them (summed over each KV head's query heads) into front.score, 0 past a
    segment's slots. `read` takes the logits and the value mix (a quantized block's: fused kernels or
    compress/attend.py), each form read in the basis it stores (a rotated one: the query rotated, the output back)."""
    keys, values = (f if f.quantized else Plain(f.expanded(qg.dtype)) for f in map(as_form, (front.k, front.v)))
    if read.kernels is not None and fused_decode.fits(keys, values, qg) and fused_decode.kernel() is not None:
        return _one_call(qg, front, policy, segments, softcap, keys, values)
    qg = rotated_if(qg, keys.rotated)  # a quantized form is read in place, a plain one in the compute dtype
    b, kv, g, d = qg.shape
    top = front.pos.shape[-1]
    out = torch.empty(qg.shape, dtype=qg.dtype, device=qg.device)
    att_sum = None if len(segments) == 1 or not policy.needs_scores else torch.zeros(b, kv, top, device=qg.device)
    for r0, r1, used in segments:
        att = capped(read.logits(qg[r0:r1], keys.cut(r0, r1, used).held()) * d ** -0.5, softcap)
        att = att.masked_fill((front.pos[r0:r1, :, :used] < 0)[:, :, None], float("-inf")).softmax(-1)
        out[r0:r1] = read.mix(att, values.cut(r0, r1, used).held(), qg.dtype)  # (r, kv, g, d)
        if att_sum is not None:
            att_sum[r0:r1, :, :used] = att.sum(2)
        elif policy.needs_scores:
            att_sum = att.sum(2)
    if policy.needs_scores:
        policy.accumulate(front.score, att_sum)  # (b, kv, top): 0 on every slot past a segment's used ones
    return unrotated_if(out, values.rotated)


def _one_call(qg, front: KVBlock, policy: KVPolicy, segments: list, softcap, keys, values) -> torch.Tensor:
    """_scored's attention of a quantized block by one compiled call a segment (compress/fused_decode.py): qg
    (b, kv, g, d) and the output in the model's basis; the probabilities summed over g accumulated as _scored's."""
    kn, want = fused_decode.kernel(), policy.needs_scores
    if len(segments) == 1:
        out, att_sum = fused_decode.attend(kn, qg, keys, values, front.pos, softcap, want)
    else:
        b, kv = qg.shape[:2]
        out = torch.empty(qg.shape, dtype=qg.dtype, device=qg.device)
        att_sum = torch.zeros(b, kv, front.pos.shape[-1]) if want else None
        for r0, r1, used in segments:
            o, s = fused_decode.attend(kn, qg[r0:r1], keys.cut(r0, r1, used), values.cut(r0, r1, used),
                                       front.pos[r0:r1], softcap, want)
            out[r0:r1] = o
            if want:
                att_sum[r0:r1, :, :used] = s
    if want:
        policy.accumulate(front.score, att_sum)  # (b, kv, top): 0 on every slot past a segment's used ones
    return out
