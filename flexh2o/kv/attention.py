"""Attention over a KV block, with the block's policy applied: prefill (chunked) and one decode step.

Grouped heads: query head n reads KV head n // group. Probabilities are accumulated per KV head, summed over
the query heads of its group, in fp32.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flexh2o.compress import attend, fused_attend
from flexh2o.compress.codec import assign, expand, expand_stored
from flexh2o.compress.rotation import rotated_if, unrotated_if
from flexh2o.kv.cache import KVBlock, merged_values, row_extents
from flexh2o.kv.policies.base import KVPolicy, Observed
from flexh2o.kv.segments import decode_segments
from flexh2o.kv.step_rows import StepRows
from flexh2o.storage.freed_memory import MAPPED_FROM
from flexh2o.tensors import moved


# torch (2.11, an H200) picks cuDNN's fused attention first, and cuDNN builds a graph for each new masked shape,
# hundreds of ms each (a new prompt length, a cache of a new width: inside the timed run); the others build nothing
CUDA_SDPA = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
WORKSPACE = 16 << 20  # bytes of fp32 attention probabilities per prefill chunk on CUDA (the batch shares it)
CPU_WORKSPACE = 3 * MAPPED_FROM // 4  # the chunk's copies under glibc's mmap threshold: reused, not faulted in anew


def sdpa(q, k, v, attn_mask=None, enable_gqa: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention, on CUDA without the cuDNN backend (CUDA_SDPA)."""
    if q.is_cuda:
        with sdpa_kernel(list(CUDA_SDPA)):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)


def prefill_chunk(b: int, heads: int, t: int, max_chunk: int, device: str) -> int:
    """Queries per prefill chunk: its (b, heads, chunk, t) fp32 scores within `device`'s workspace (above)."""
    return max(1, min(max_chunk, t, (CPU_WORKSPACE if device == "cpu" else WORKSPACE) // (4 * b * heads * t)))


def prefill(q, k, v, pos, policy: KVPolicy, layer: int, blk: KVBlock, chunk: int, scores: bool = True,
            copies: int = 1, window: Optional[int] = None, softcap: Optional[float] = None):
    """q (b, n, t, d), k/v (b, kv, t, d), pos (b, t) int64 (-1 = padding) -> out (b, n, t, d); the kept tokens
    are packed into `blk` (an empty block, or rows of one).

    copies > 1: the block holds `copies` x b rows, copy c of row r being row c * b + r (the lanes of one evaluation
    over the same prompts): attention runs once over the b rows given and every copy's row keeps its own tokens
    under its own policy, with the scores its own query weights give (computed once per distinct weights).

    Probabilities are materialised (chunk by chunk) only when the policy scores tokens and `scores` says an
    eviction can happen, or logits are soft-capped; otherwise the fused attention kernel runs.

    window (a sliding-window layer): query p sees the keys of positions p - window < k <= p, and the block keeps
    only what the next query sees (positions > newest + 1 - window), the policy choosing among those alone.
    softcap: attention logits become softcap * tanh(logits / softcap) before the mask (Gemma 2)."""
    b, n, t, d = q.shape
    kv = k.shape[1]
    g = n // kv
    rows = b * copies
    every = pos.repeat(copies, 1) if copies > 1 else pos  # (rows, t): each row of the block
    valid = pos >= 0  # (b, t)
    out = torch.empty_like(q)
    qg = q.view(b, kv, g, t, d)
    idx = torch.arange(t, device=q.device)
    wanted = scores and policy.needs_scores
    which = torch.zeros(copies, dtype=torch.int64, device=q.device)  # copy -> its row of `weights`
    if wanted:  # (rows, t) fp32 per query, as one tensor per distinct copy
        weights, which = _distinct(policy.query_weights(every).view(copies, b, t))
    score = torch.zeros(len(weights) if wanted else 1, b, kv, t, dtype=torch.float32, device=q.device)
    chunk = prefill_chunk(b, n, t, chunk, q.device.type)
    causal_only = window is None and q.device.type == "cpu" and bool(valid.all())  # (no host sync off the CPU)
    fused = not wanted and softcap is None  # no probabilities needed: the fused kernel
    qs = qg if fused else qg * d ** -0.5
    for s in range(0, t, chunk):
        e = min(t, s + chunk)  # the chunk's queries see keys before e only: the fused kernel reads no later one
        f = e if fused else t  # (a matmul over a slice of the keys copies them, costing more than it saves)
        kc, vc, ki = k[:, :, :f], v[:, :, :f], idx[None, :f]
        if causal_only:  # no padding, no window: one (1, c, f) mask for every row
            allowed = (ki <= idx[s:e, None])[None]
        else:
            allowed = (ki <= idx[s:e, None])[None] & valid[:, None, :f]  # (b, c, f)
            if window is not None:  # left padding shifts index and position alike: the window holds in either
                allowed = allowed & (ki > idx[s:e, None] - window)[None]
            allowed = allowed | (ki == idx[s:e, None])[None]  # a padding query sees itself: no NaN
        if fused:
            out[:, :, s:e] = sdpa(q[:, :, s:e], kc, vc, attn_mask=allowed[:, None], enable_gqa=g > 1)
            continue
        att = _capped(torch.einsum("bhgqd,bhkd->bhgqk", qs[:, :, :, s:e], kc).float(), softcap)
        att = att.masked_fill_(~allowed[:, None, None], float("-inf")).softmax(-1)
        out[:, :, s:e] = torch.einsum("bhgqk,bhkd->bhgqd", att.to(v.dtype), vc).reshape(b, n, e - s, d)
        for j, w in enumerate(weights if wanted else ()):  # padding queries add 0
            score[j] += torch.matmul(w[:, None, None, None, s:e], att).sum(2)[:, :, 0]
    score = score[0] if copies == 1 else score[which].view(rows, kv, t)
    if copies > 1:
        k, v = k.repeat(copies, 1, 1, 1), v.repeat(copies, 1, 1, 1)
    keys32 = k.float() if policy.needs_keys or (policy.merges and scores) else None
    kpos = every[:, None, :].expand(rows, kv, t)
    cur = every.max(-1).values  # (rows,)
    if window is not None:  # what the next query cannot see is gone before the policy chooses
        kpos = torch.where(kpos > (cur + 1 - window)[:, None, None], kpos, -1)
    keep = policy.prefill_keep(kpos, score, layer, cur, obs=Observed(keys32, v).only(policy))
    if policy.merges and scores:  # the dropped prompt tokens' values go into kept ones (the policy says where)
        target, mass = policy.merge_plan(kpos, score, keys32, (kpos >= 0) & ~keep)
        v = merged_values(v.float(), target, mass)[0].to(v.dtype)
    _pack(k, v, kpos, score, keep, blk)
    return out


def _capped(logits: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """Soft-capped attention logits (Gemma 2): softcap * tanh(logits / softcap); unchanged without a cap."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _distinct(x: torch.Tensor) -> tuple:
    """x (copies, ...) -> (the distinct copies (m, ...), index (copies,) of each copy among them)."""
    if len(x) == 1:
        return x, torch.zeros(1, dtype=torch.int64, device=x.device)
    uniq, inverse = torch.unique(x.flatten(1), dim=0, return_inverse=True)
    return uniq.view(-1, *x.shape[1:]), inverse


def _pack(k, v, pos, score, keep, blk: KVBlock) -> None:
    """Move kept tokens into the first slots of an empty block; the rest stay empty."""
    b, kv, t, d = k.shape
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :blk.pos.shape[-1]]  # kept first
    m = order.shape[-1]
    take = keep.gather(-1, order)
    first = (slice(None), slice(None), slice(0, m))
    blk.calibrate(k, pos >= 0)  # keys per channel: scales from every prompt token, kept or not
    kept = [x.gather(2, order[..., None].expand(b, kv, m, d)) for x in (k, v)]
    assign(blk.k, first, kept[0])  # quantized here when compressed
    assign(blk.v, first, kept[1])
    blk.pos[:, :, :m] = torch.where(take, pos.gather(-1, order), -1)
    for x, val in zip((blk.k, blk.v), kept):
        if hasattr(x, "remember_prompt"):  # the newest tokens also kept exact (compress/recent.py)
            x.remember_prompt(blk.pos[:, :, :m], val)
    blk.score[:, :, :m] = torch.where(take, score.gather(-1, order), 0.0)


def decode(q, k, v, cur_pos, blk: KVBlock, policy: KVPolicy, layer: int, window: Optional[int] = None,
           softcap: Optional[float] = None, evicts: bool = True, at: Optional[StepRows] = None) -> torch.Tensor:
    """One new token. q (b, n, 1, d), k/v (b, kv, 1, d), cur_pos (b,) -> out (b, n, 1, d).

    The new K/V are appended to `blk` (in place, on the block's device; the block remembers the slot); attention
    runs there, each segment of rows over the slots its rows use (kv/segments.py: empty slots past the last used
    one are skipped, not just masked, unless one masked call over every row reads little more: `one_call_or`); scores
    are updated and at most one token per row is evicted (its slot is free for the next step). The policy sees
    the block's slots up to the last one any row uses (`KVBlock.front`).
    window, softcap: as in prefill; after the attention a windowed layer drops the token the next query will not
    see before the policy chooses (the block holds window - 1 tokens at most between steps).
    evicts False (LayerCompute.evicts) and no window: nothing is ever dropped, so every row holds its positions
    0..cur_pos in slots 0..cur_pos and the block's free slot and extents are read from cur_pos (`at`: the step's
    kv/step_rows.StepRows, when the caller has one: what the step's layers share is made there once), not searched;
    a policy that scores nothing is then not asked to evict.
    """
    dev, home = blk.pos.device, q.device
    q, k, v, cur_pos = moved(q, dev), moved(k, dev), moved(v, dev), moved(cur_pos, dev)
    b, n, _, d = q.shape
    kv = blk.pos.shape[1]
    in_order = not evicts and window is None and (at is not None or dev.type == "cpu")  # off the CPU: from `at`
    step = (StepRows(cur_pos.tolist()) if at is None else at) if in_order else None
    blk.append(k[:, :, 0], v[:, :, 0], cur_pos, in_order, step and step.at, step)
    qg = q.view(b, kv, n // kv, d)
    # per row, its slots up to the last used one (once per step: the policy too)
    extents = step.extents if in_order else row_extents(blk.pos)
    segments = (step.made(("segments", b, blk.pos.shape[-1], str(dev)), lambda: decode_segments(blk.pos, extents))
                if in_order else decode_segments(blk.pos, extents))
    top = max(u for _, _, u in segments)  # slots past every row's last used one are never read: not expanded
    quantized = not isinstance(blk.k, torch.Tensor)  # read in place (compress/attend.py), through _scored
    if not policy.needs_scores and softcap is None and in_order and not quantized:  # nothing to score or evict
        (keys, rk), (values, rv) = (expand_stored(x, q.dtype) for x in blk.front_kv(top))
        out = _fused(rotated_if(qg, rk), keys, values, blk.pos, segments, step)
        return moved(unrotated_if(out, rv).reshape(b, n, 1, d), home)
    front = blk.front(top)  # all the step reads and the policy sees
    if quantized:
        (keys, rk), (values, rv) = (front.k, attend.is_rotated(front.k)), (front.v, attend.is_rotated(front.v))
    else:
        (keys, rk), (values, rv) = expand_stored(front.k, q.dtype), expand_stored(front.v, q.dtype)
    if not policy.needs_scores and softcap is None and not quantized:  # one fused kernel per segment
        out = _fused(rotated_if(qg, rk), keys, values, front.pos, segments, None)
    else:
        read = fused_attend.reader() if quantized else fused_attend.PLAIN  # chosen once a process
        out = _scored(rotated_if(qg, rk), keys, values, front, policy, segments, softcap, read)
    out = unrotated_if(out, rv)
    if window is not None:
        front.evict((front.pos >= 0) & (front.pos <= (cur_pos + 1 - window).view(-1, 1, 1)))
    values = expand(front.v, torch.float32) if policy.needs_values else None  # what the cache holds
    keys32 = expand(front.k, torch.float32) if policy.needs_keys or policy.merges else None
    evict = policy.decode_evict(front.pos, front.score, layer, cur_pos, extents=extents,
                                obs=Observed(keys32, values).only(policy))
    if policy.merges and evict is not None:
        front.merge(*policy.merge_plan(front.pos, front.score, keys32, evict, extents=extents))
        blk.written = front.written
    front.evict(evict)
    return moved(out.reshape(b, n, 1, d), home)


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


def _scored(qg, keys, values, front: KVBlock, policy: KVPolicy, segments: list, softcap,
            read: fused_attend.Reader) -> torch.Tensor:
    """Attention with its probabilities materialised (fp32), per segment: qg (b, kv, g, d) -> (b, kv, g, d); the
    policy accumulates them (summed over each KV head's query heads) into front.score, 0 past a segment's slots.
    `read` takes the logits and the value mix (a quantized block's: fused kernels or compress/attend.py)."""
    b, kv, g, d = qg.shape
    top = front.pos.shape[-1]
    out = torch.empty(qg.shape, dtype=qg.dtype, device=qg.device)
    att_sum = None if len(segments) == 1 or not policy.needs_scores else torch.zeros(b, kv, top, device=qg.device)
    for r0, r1, used in segments:
        att = read.logits(qg[r0:r1], attend.cut(keys, r0, r1, used))
        att = _capped(att * d ** -0.5, softcap)
        att = att.masked_fill((front.pos[r0:r1, :, :used] < 0)[:, :, None], float("-inf")).softmax(-1)
        out[r0:r1] = read.mix(att, attend.cut(values, r0, r1, used), qg.dtype)  # (r, kv, g, d)
        if att_sum is not None:
            att_sum[r0:r1, :, :used] = att.sum(2)
        elif policy.needs_scores:
            att_sum = att.sum(2)
    if policy.needs_scores:
        policy.accumulate(front.score, att_sum)  # (b, kv, top): 0 on every slot past a segment's used ones
    return out
