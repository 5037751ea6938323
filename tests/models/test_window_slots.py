"""A sliding window is a fact of the model (since 2026-12-02, 0a131b6): a windowed layer's cache blocks hold
min(window, context) slots, or min(window, budget + 1) under a KV policy, and a full layer's the policy's
(ModelConfig.layer_slots).
The KV cache allocates that per layer in every tier, the memory plan and --dry-run count it (a Gemma-like config's
cache bytes are the sum over layers by hand), and the largest batch grows. The models still compute exactly:
the tiny Gemma 2/3 and Mistral checkpoints (tests/family_models.py) decode transformers' own tokens with the cache
in memory, on the cpu tier and on disk, including a Mistral window longer than the prompt but shorter than prompt +
generated; every KV policy gives the same tokens with the reduced slots as with a full-length block (plain and
quantized cache, disk tier); H2O on models with windowed and full layers (Qwen2's upper layers; Gemma 2, with
tests/reference_gemma.py's forward pass) equals tests/reference_kv.py."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")

import family_models as fm  # noqa: E402
import reference_kv as ref  # noqa: E402
from test_families import GEN, LENS, _generate, _ref_weights, family, prompts  # noqa: E402,F401 (fixtures)
from test_llama import hf_step_logits  # noqa: E402
from flexh2o.generation import run as run_module  # noqa: E402  (where a generate() call builds its KVCache)
from flexh2o.config import ModelConfig  # noqa: E402
from flexh2o.kv.cache import KVCache  # noqa: E402
from flexh2o.kv.layout import CacheLayout, CacheQuant  # noqa: E402
from flexh2o.kv.policies import POLICIES, Budget  # noqa: E402
from flexh2o.kv.spec import KVSpec  # noqa: E402
from flexh2o.placement import TIERS, Percent  # noqa: E402
from flexh2o.planning.memory_plan import largest_batch, plan_memory  # noqa: E402
from flexh2o.run_config import RunConfig  # noqa: E402
from flexh2o.weights.convert import convert  # noqa: E402

W = fm.WINDOW
CACHE_PLACES = {"cache-gpu": [100, 0, 100, 0, 100, 0], "cache-cpu": [100, 0, 0, 100, 100, 0],
                "all-on-disk": [0, 0, 0, 0, 100, 0]}
ATOL = RTOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")


def gemma_like(layers: int = 6, window: int = W) -> ModelConfig:
    """Gemma 2's shape in small: local (windowed) and global layers alternating, 2 KV heads of 32."""
    return ModelConfig("gemma-like", "gemma2", hidden=64, num_layers=layers, num_heads=4, num_kv_heads=2, ffn=128,
                       vocab=1000, max_positions=8192, head_size=32, sliding_window=window,
                       layer_kinds="sf" * (layers // 2), tie_embeddings=True)


def _rc(cfg: ModelConfig, percent, kv: KVSpec = KVSpec(), **kw) -> RunConfig:
    base = dict(model=cfg, percent=Percent.parse(list(percent)), gpu_batch_size=2, num_gpu_batches=1,
                prompt_len=40, gen_len=8, dtype=torch.float32, kv=kv)
    return RunConfig(**{**base, **kw})


# ---- slot counts, the plan and the largest batch ----------------------------------------------------------------
def test_slots_per_layer():
    """min(window, context) on windowed layers, the policy's on full ones; a budget applies on top of the window."""
    rc = _rc(gemma_like(4), CACHE_PLACES["cache-gpu"])
    assert rc.layer_slots() == (W, 48, W, 48) and rc.cache_slots() == 48
    assert rc.with_(kv=KVSpec("h2o", Budget(3, 3))).layer_slots() == (7, 7, 7, 7)  # budget + 1 < window
    assert rc.with_(kv=KVSpec("h2o", Budget(10, 10))).layer_slots() == (W, 21, W, 21)
    assert rc.with_(prompt_len=8, gen_len=4).layer_slots() == (12,) * 4  # context < window
    layouts = CacheLayout.layers_of_run(rc)
    assert [lay.slots for lay in layouts] == [W, 48, W, 48] and layouts[0] is layouts[2]


@pytest.mark.parametrize("quant", [None, CacheQuant(4, 16, "channel", 2)], ids=["plain", "channel-4bit"])
@pytest.mark.parametrize("kv", [KVSpec(), KVSpec("h2o", Budget(3, 3)), KVSpec("h2o", Budget(12, 12))],
                         ids=["full", "h2o-6", "h2o-24"])
@pytest.mark.parametrize("percent", [[100, 0, 100, 0], [100, 0, 50, 25]], ids=["cache-gpu", "cache-split"])
def test_plan_cache_bytes_are_the_sum_over_layers(percent, kv, quant):
    """The plan's KV bytes per tier = the sum over its blocks of min(window, budget + 1, context) slots (a
    windowed layer) or min(budget + 1, context) (a global one) times the layout's bytes per slot, plus the
    layout's per-row bytes (channel keys' calibration)."""
    cfg = gemma_like(6)
    rc = _rc(cfg, percent, kv, num_gpu_batches=3, compress_cache=quant)
    context = rc.prompt_len + rc.gen_len
    per_policy = context if kv.budget is None else min(context, kv.budget.total + 1)
    one = CacheLayout(rc.gpu_batch_size, cfg.kv_heads, 1, cfg.head_dim, rc.dtype, quant)
    per_slot = one.kv_slot_bytes() + 8 + 4  # K and V as the layout stores them, int64 pos, fp32 score
    if quant is None:
        assert per_slot == 2 * cfg.head_dim * 4 + 12
    want = dict.fromkeys(TIERS, 0)
    for layer, homes in enumerate(rc.placement.cache):
        slots = min(per_policy, W) if layer % 2 == 0 else per_policy
        for tier in homes:
            want[tier] += rc.gpu_batch_size * cfg.kv_heads * (slots * per_slot + one.kv_row_bytes())
    plan = plan_memory(rc)
    assert {t: plan.bytes[t]["cache"] for t in TIERS} == want
    if kv.budget is None or kv.budget.total + 1 > W:  # the window did cut something
        unwindowed = plan_memory(rc.with_(model=replace(cfg, sliding_window=None)))
        assert sum(unwindowed.bytes[t]["cache"] for t in TIERS) > sum(want.values())


@pytest.mark.parametrize("kv", [KVSpec(), KVSpec("h2o", Budget(1000, 1000))], ids=["full", "h2o-2000"])
def test_largest_batch_grows_with_the_window(kv):
    """--dry-run's largest batch (the one search): a Gemma-like model with 1024-token windows at a 4096 + 64 context
    fits more sequences than the same model without them, as the plan's cache bytes say."""
    cfg = gemma_like(6, window=1024)
    rc = _rc(cfg, [100, 0, 100, 0], kv, prompt_len=4096, gen_len=64, gpu_mem=256 << 20, cpu_mem=1 << 30)
    plain = rc.with_(model=replace(cfg, sliding_window=None))
    windowed_n, plain_n = largest_batch(rc), largest_batch(plain)
    assert 0 < plain_n < windowed_n
    cache = plan_memory(rc.with_(gpu_batch_size=plain_n)).bytes["gpu"]["cache"]
    assert cache < plan_memory(plain.with_(gpu_batch_size=plain_n)).bytes["gpu"]["cache"]


def test_dry_run_text_names_the_windowed_slots():
    from flexh2o.cli.plan_text import describe_plan
    rc = _rc(gemma_like(4), [100, 0, 100, 0], gpu_mem=1 << 30, cpu_mem=1 << 30)
    assert "cache slots 48 (2 windowed layers 16)" in describe_plan(rc)


# ---- the engine's cache: what it allocates, and that it computes the same -----------------------------------------
@pytest.fixture
def caches(monkeypatch):
    """Every KVCache an engine builds, with the bytes its home tiers took for it."""
    made = []

    class Recorded(KVCache):
        def __init__(self, tiers, homes, *args, **kw):
            before = {name: tier.used for name, tier in tiers.items()}
            super().__init__(tiers, homes, *args, **kw)
            made.append((self, {name: tier.used - before[name] for name, tier in tiers.items()}))
    monkeypatch.setattr(run_module, "KVCache", Recorded)
    return made


def _full_length_blocks(monkeypatch):
    """The engine as before 2026-12-02 (0a131b6): every layer allocates the policy's slots, window or not."""
    monkeypatch.setattr(ModelConfig, "layer_slots", lambda self, slots: (slots,) * self.num_layers)


@pytest.mark.parametrize("name, place", [("mistral", "all-on-disk"), ("gemma2", "cache-cpu"),
                                         ("gemma3", "all-on-disk")])
def test_tokens_equal_transformers_with_window_slots(name, place, family, prompts, caches, tmp_path):
    """Greedy tokens and logits equal transformers' with the windowed layers' blocks at `window` slots on the cpu
    tier and (weights and cache) on disk (test_families runs them with the cache on the compute side); the tiers
    took the plan's cache bytes."""
    model, ckpt, cfg = family(name)
    gen = _generate(cfg, ckpt, prompts, CACHE_PLACES[place], tmp_path)
    want = hf_step_logits(model, prompts, gen.tokens)
    torch.testing.assert_close(torch.stack(gen.step_logits, 1), want, atol=ATOL, rtol=RTOL)
    assert torch.equal(gen.tokens, want.argmax(-1))
    (cache, took), = caches
    slots = [W if cfg.window(i) else max(LENS) + GEN for i in range(cfg.num_layers)]
    assert [lay.slots for lay in cache.layouts] == slots
    rc = _rc(cfg, CACHE_PLACES[place])
    plan = plan_memory(rc)
    tier = "disk" if place == "all-on-disk" else place.split("-")[1]
    assert took[tier] == plan.bytes[tier]["cache"] == sum(
        rc.gpu_batch_size * cfg.kv_heads * s * (2 * cfg.head_dim * 4 + 12) for s in slots)


@pytest.fixture(scope="module")
def mistral_44(tmp_path_factory):
    """The Mistral checkpoint with a 44-token window: longer than the 40-token prompt, shorter than prompt + 8."""
    root = tmp_path_factory.mktemp("mistral44")
    model = fm.hf_model("mistral")
    model.config.sliding_window = 44
    src = fm.save(model, str(root / "hf"))
    assert json.load(open(os.path.join(src, "config.json")))["sliding_window"] == 44
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager", dtype=torch.float32)
    result = convert(src, str(root / "ckpt"), dtype="float32")
    return hf.eval(), str(root / "ckpt"), result.config


def test_mistral_window_between_prompt_and_context(mistral_44, prompts, caches, tmp_path):
    """Mistral with a window of 44 at 40 + 8 tokens, weights and cache on disk: transformers' tokens and logits
    from blocks of 44 slots, though the window cuts only the last steps (without it those differ)."""
    model, ckpt, cfg = mistral_44
    assert cfg.sliding_window == 44
    gen = _generate(cfg, ckpt, prompts, CACHE_PLACES["all-on-disk"], tmp_path)
    want = hf_step_logits(model, prompts, gen.tokens)
    torch.testing.assert_close(torch.stack(gen.step_logits, 1), want, atol=ATOL, rtol=RTOL)
    assert torch.equal(gen.tokens, want.argmax(-1))
    assert [lay.slots for lay in caches[0][0].layouts] == [44] * 3
    unwindowed = _generate(replace(cfg, sliding_window=None), ckpt, prompts, CACHE_PLACES["cache-gpu"], tmp_path)
    assert (torch.stack(unwindowed.step_logits, 1) - want)[:, -3:].abs().max() > 1e-2


def _same_generation(cfg, ckpt, prompts, percent, tmp_path, kv, monkeypatch, **kw) -> None:
    """The run with the windowed layers' slots reduced, then with full-length blocks: the same tokens and logits."""
    rc = _rc(cfg, percent, kv, path=ckpt, offload_dir=str(tmp_path), **kw)
    short = _run(rc, prompts)
    with monkeypatch.context() as m:
        _full_length_blocks(m)
        long = _run(rc, prompts)
    assert torch.equal(short.tokens, long.tokens), "tokens differ with the reduced slots"
    torch.testing.assert_close(torch.stack(short.step_logits), torch.stack(long.step_logits), atol=1e-5, rtol=1e-5)


def _run(rc: RunConfig, prompts: list):
    from flexh2o.engine import Engine
    with Engine(rc) as eng:
        return eng.generate(prompts, GEN, record_logits=True)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_same_with_window_slots(policy, family, prompts, caches, monkeypatch, tmp_path):
    """Gemma 2 (windowed and full layers) under each policy at a budget of 20 (> the 16-token window): the windowed
    layers' blocks of 16 slots give the tokens and logits of full-length blocks."""
    _, ckpt, cfg = family("gemma2")
    kv = KVSpec.of_total(policy, None if policy == "full" else 20, num_sinks=2)
    _same_generation(cfg, ckpt, prompts, CACHE_PLACES["cache-gpu"], tmp_path, kv, monkeypatch)
    assert caches[0][0].layouts[0].slots == W < caches[0][0].layouts[1].slots


@pytest.mark.parametrize("policy, quant", [("full", CacheQuant(4, 16, "channel", 2)), ("h2o", None),
                                           ("h2o", CacheQuant(4, 16, "token")),
                                           ("merge", CacheQuant(4, 16, "channel", 2))],
                         ids=["full-channel", "h2o-plain", "h2o-token", "merge-channel"])
def test_disk_and_quantized_cache_same_with_window_slots(policy, quant, family, prompts, monkeypatch, tmp_path):
    """The same on the disk tier (blocks rewritten whole) and with the cache quantized (slots written alone)."""
    _, ckpt, cfg = family("gemma3")
    kv = KVSpec.of_total(policy, None if policy == "full" else 20, num_sinks=2)
    _same_generation(cfg, ckpt, prompts, CACHE_PLACES["all-on-disk"], tmp_path, kv, monkeypatch,
                     compress_cache=quant)


@pytest.mark.parametrize("budget", [Budget(10, 10), Budget(12, 4)], ids=["h2o-20", "h2o-16"])
def test_h2o_on_windowed_and_full_layers_equals_reference(budget, family, prompts, caches, tmp_path):
    """Qwen2 with its upper layers windowed: the full layer holds budget + 1 slots, the windowed ones 16, and H2O's
    tokens, logits and kept counts per layer equal the keep-mask reference."""
    model, ckpt, cfg = family("qwen2-window")
    gen = _generate(cfg, ckpt, prompts, CACHE_PLACES["all-on-disk"], tmp_path, KVSpec("h2o", budget))
    assert [lay.slots for lay in caches[0][0].layouts] == [budget.total + 1, W, W]
    policy = ref.RefPolicy("h2o", budget.heavy, budget.recent)
    w = _ref_weights(model)
    refs = [ref.generate(cfg, w, p, GEN, policy) for p in prompts]
    _equals_references(gen, refs)


def _equals_references(gen, refs) -> None:
    """The engine's tokens, step logits and per-layer kept counts equal the reference runs', sequence by sequence."""
    for i, r in enumerate(refs):
        assert gen.tokens[i].tolist() == r.tokens, f"sequence {i}: tokens differ"
        torch.testing.assert_close(torch.stack(gen.step_logits)[:, i], torch.stack(r.step_logits), atol=ATOL,
                                   rtol=RTOL)
    for layer, n in gen.kept.items():
        assert n == max(len(kept) for r in refs for kept in r.kept[layer]), f"layer {layer} kept count"


@pytest.mark.parametrize("budget", [Budget(10, 10), Budget(3, 3)], ids=["h2o-20", "h2o-6"])
def test_h2o_on_gemma2_equals_reference(budget, family, prompts, caches, tmp_path):
    """Gemma 2 (local and global layers, soft-capped logits), weights and cache on disk: H2O's tokens, logits and
    kept counts equal the reference with tests/reference_gemma.py's forward pass; the local layers' blocks hold
    min(16, budget + 1) slots."""
    from reference_gemma import gemma2_forward
    model, ckpt, cfg = family("gemma2")
    gen = _generate(cfg, ckpt, prompts, CACHE_PLACES["all-on-disk"], tmp_path, KVSpec("h2o", budget))
    slots = budget.total + 1
    assert [lay.slots for lay in caches[0][0].layouts] == [min(W, slots), slots, min(W, slots)]
    policy = ref.RefPolicy("h2o", budget.heavy, budget.recent)
    w = _ref_weights(model)
    full = ref.generate(cfg, w, prompts[0], 4, ref.RefPolicy("full"), forward=gemma2_forward)
    hf = hf_step_logits(model, prompts[:1], torch.tensor([full.tokens]))[0]
    torch.testing.assert_close(torch.stack(full.step_logits), hf, atol=ATOL, rtol=RTOL)  # the reference itself
    refs = [ref.generate(cfg, w, p, GEN, policy, forward=gemma2_forward) for p in prompts]
    _equals_references(gen, refs)
