"""Memory tiers (cpu -> gpu tier is a no-op on a CPU-only machine), the memory plan, and seeded sampling."""
from __future__ import annotations

import pytest
import torch

from flexh2o.config import ModelConfig, from_name
from flexh2o.engine import Engine
from flexh2o.kv.spec import KVSpec, resolve_budget
from flexh2o.planning.memory_plan import largest_batch, plan_memory
from flexh2o.units import parse_bytes
from flexh2o.placement import Percent, weight_homes
from flexh2o.models import layer_specs
from flexh2o.run_config import RunConfig
from flexh2o.sampling import Sampler
from flexh2o.storage.base import TierFullError
from flexh2o.storage.memory import MemoryTier

TINY = ModelConfig("tiny", "opt", hidden=64, num_layers=4, num_heads=4, ffn=256, vocab=1000, max_positions=128)


def test_cpu_to_gpu_tier_is_a_view_on_cpu():
    cpu = MemoryTier("cpu", torch.device("cpu"), 1 << 20)
    h = cpu.alloc((4, 8), torch.float32)
    t = cpu.load(h, torch.device("cpu"), torch.float32)
    assert t.data_ptr() == h.data_ptr()  # no copy
    assert cpu.load(h, torch.device("cpu"), torch.bfloat16).data_ptr() != h.data_ptr()  # a cast must copy
    with pytest.raises(TierFullError, match="--cpu-mem"):
        cpu.alloc((1 << 20,), torch.float32)


def test_weight_split_follows_bytes():
    specs = layer_specs(from_name("opt-1.3b"))
    homes = weight_homes(specs, Percent.parse([30, 30, 30, 30]).shares("weights"))
    size = {s.name: s.numel for layer in specs for s in layer}
    total = sum(size.values())
    for tier, share in (("gpu", 0.3), ("cpu", 0.3), ("disk", 0.4)):
        got = sum(size[n] for n, t in homes.items() if t == tier) / total
        assert abs(got - share) < 0.08, (tier, got)


def test_plan_reports_actual_bytes(tmp_path):
    rc = RunConfig(model=TINY, percent=Percent.parse([30, 30, 30, 30]),
                   gpu_batch_size=2, num_gpu_batches=2, prompt_len=8,
                   gen_len=4, dtype=torch.float32, offload_dir=str(tmp_path))
    plan = plan_memory(rc)
    with Engine(rc) as eng:
        eng.generate([[5, 6, 7]] * 4, 4)
        for tier in ("cpu", "disk"):
            homed = plan.bytes[tier]["weights"] + plan.bytes[tier]["cache"] + plan.bytes[tier]["activations"]
            assert eng.tiers[tier].peak <= homed and eng.tiers[tier].peak >= plan.bytes[tier]["weights"]


def test_h2o_fits_larger_batches_than_full():
    base = RunConfig(model=from_name("opt-30b"), percent=Percent.parse([0, 100, 100, 0]), prompt_len=512, gen_len=512,
                     gpu_mem=16 << 30, cpu_mem=200 << 30)
    full = largest_batch(base)
    h2o = largest_batch(base.with_(kv=KVSpec("h2o", resolve_budget("h2o", 512, 0.2))))
    assert full >= 1 and h2o >= 3 * full
    assert plan_memory(base.with_(gpu_batch_size=full + 1)).overflow()[0] == "gpu"


def test_parse_bytes():
    assert parse_bytes("16GB") == 16 << 30 and parse_bytes("512MiB") == 512 << 20 and parse_bytes("100") == 100
    with pytest.raises(ValueError):
        parse_bytes("-1GB")


def test_sampling_seeded_and_top_p():
    logits = torch.randn(3, 50)
    a = [Sampler(1.0, 0.9, seed=3)(logits) for _ in range(2)]
    s = Sampler(1.0, 0.9, seed=3)
    assert torch.equal(s(logits), a[0])
    top1 = Sampler(1.0, 1e-6, seed=0)(logits)  # top-p tiny = greedy
    assert torch.equal(top1, logits.argmax(-1))


def test_sampled_generation_same_with_and_without_overlap(tmp_path):
    outs = []
    for overlap in (True, False):
        rc = RunConfig(model=TINY, percent=Percent.parse([0, 50, 50, 0]),
                       gpu_batch_size=2, num_gpu_batches=2, prompt_len=6,
                       gen_len=5, dtype=torch.float32, overlap=overlap, offload_dir=str(tmp_path))
        with Engine(rc) as eng:
            outs.append(eng.generate([[4, 5, 6]] * 4, 5, Sampler(0.8, 0.9, seed=1)).tokens)
    assert torch.equal(*outs)


def test_decode_stores_one_slot_per_head(tmp_path):
    """A cpu-tier cache under h2o: each decode step writes one K/V slot per head (plus the small pos/score rows)."""
    from flexh2o.kv.policies import Budget
    stored = {}
    for gen in (1, 5):
        rc = RunConfig(model=TINY, percent=Percent.parse([100, 0, 0, 100]),
                       gpu_batch_size=2, num_gpu_batches=2, prompt_len=12,
                       gen_len=gen, dtype=torch.float32, kv=KVSpec("h2o", Budget(3, 3)),
                       offload_dir=str(tmp_path))
        with Engine(rc) as eng:
            eng.generate([list(range(4, 16))] * 4, gen)
            stored[gen] = eng.tiers["cpu"].bytes_stored
    b, heads, d, slots, blocks = 2, TINY.kv_heads, TINY.head_dim, 7, TINY.num_layers * 2
    per_step = blocks * (2 * b * heads * d * 4 + b * heads * slots * (8 + 4))
    assert (stored[5] - stored[1]) == 4 * per_step
