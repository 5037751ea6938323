"""The int4 kernel's scales and zeros of weights the compute side uses in place are built once and kept for the run
(weights/forms.py), where the memory plan has room for them: same results as building them at every load, the
plan counting their bytes, nothing kept for weights read from a tier that copies them."""
from __future__ import annotations

import pytest
import torch

from flexh2o.compress import CompressionSpec, weight_spec
from flexh2o.compress.kernels import PackedWeight, kernel_scales, scales_bytes
from flexh2o.config import ModelConfig
from flexh2o.engine import Engine
from flexh2o.placement import Percent
from flexh2o.planning.memory_plan import plan_memory
from flexh2o.run_config import RunConfig
from flexh2o.compress.choice import PHASES
from flexh2o.weights.forms import WeightForms

# vocab a multiple of 32: the tied token table is in the kernel's order too (the head runs it at decode)
TINY = ModelConfig("tiny32", "opt", hidden=64, num_layers=2, num_heads=4, ffn=256, vocab=1024, max_positions=128)
SPEC = CompressionSpec(4, 64, 1)
BOTH = {"prefill": True, "decode": True}

pytestmark = pytest.mark.usefixtures("one_thread")


def _rc(offload_dir, percent=(100, 0, 100, 0), **kw) -> RunConfig:
    base = dict(model=TINY, percent=Percent.parse(list(percent)), gpu_batch_size=3, prompt_len=10, gen_len=4,
                dtype=torch.float32, offload_dir=offload_dir, compress_weight=SPEC, weight_kernel="int4")
    return RunConfig(**{**base, **kw})


def _matmuls(rc) -> set:
    """Every block matmul and the head's table: the weights the kernel multiplies at decode."""
    layers = rc.placement.weights.layer_specs
    blocks = {s.name for layer in layers[1:-1] for s in layer if len(s.shape) == 2}
    return blocks | {s.name for s in layers[-1] if len(s.shape) == 2}


def _logits(eng, prompts) -> torch.Tensor:
    return torch.stack(eng.generate(prompts, 4, record_logits=True).step_logits, 1)


@pytest.mark.parametrize("percent", [(100, 0, 100, 0), (0, 100, 100, 0)])
def test_weights_in_memory_keep_their_scales_and_give_the_same_logits(offload_dir, percent):
    # 8 rows: at 3 the load's transient (storing the 4-bit vocab table) is the gpu tier's peak, not the run, and the
    # scales, built after it, always fit (memory_plan.store_transient_bytes)
    rc = _rc(offload_dir, percent, gpu_batch_size=8)
    prompts = [list(range(5 + 100 * i, 15 + 100 * i)) for i in range(8)]
    with Engine(rc) as eng:
        names = eng.weights.kept_scales
        assert names == _matmuls(rc)
        specs = {s.name: s for layer in rc.placement.weights.layer_specs for s in layer}  # the tied table once
        want_bytes = sum(scales_bytes(specs[n].shape, weight_spec(specs[n].shape, SPEC, n)) for n in names)
        assert eng.plan.kept_scales == eng.forms.kept_scales_bytes(rc.placement.weights) == want_bytes > 0
        kept = _logits(eng, prompts)
        built = eng.weights._scales  # what the run built and holds
        assert set(built) == names and sum(t.numel() * t.element_size() for t in built.values()) == want_bytes
        a, _ = eng.weights.load_layer(1, torch.device("cpu"), torch.float32, "decode")
        b, _ = eng.weights.load_layer(1, torch.device("cpu"), torch.float32, "decode")
        name = "model.decoder.layers.0.fc1.weight"
        assert a[name].scales_zeros is b[name].scales_zeros  # built once
        ct = eng.weights.tiers[name].load_compressed(eng.weights.handles[name], torch.device("cpu"))
        assert torch.equal(a[name].scales_zeros, kernel_scales(ct.meta))
        eng.weights.release(a)
        eng.weights.release(b)
        room = eng.plan.total("gpu") - eng.plan.kept_scales
    # a gpu tier one byte short of holding them: the same run builds them at every load, the same logits
    tight = rc.with_(gpu_mem=room + want_bytes - 1)
    with Engine(tight) as eng:
        assert eng.plan.kept_scales == 0 and eng.weights.kept_scales == frozenset()
        assert eng.plan.total("gpu") == room
        assert torch.equal(_logits(eng, prompts), kept)


def test_nothing_kept_for_weights_read_from_disk_or_without_the_kernel(offload_dir):
    disk = _rc(offload_dir, (0, 0, 100, 0))
    assert WeightForms.of_run(disk, PHASES).kept_scale_names(disk.placement.weights) == frozenset()
    assert plan_memory(disk, forms=WeightForms.of_run(disk, PHASES)).kept_scales == 0
    mem = _rc(offload_dir)
    assert WeightForms.of_run(mem, ["prefill"]).kept_scale_names(mem.placement.weights) == frozenset()
    generic = _rc(offload_dir, weight_kernel="generic")
    with Engine(generic) as eng:
        assert eng.plan.kept_scales == 0 and eng.weights.kept_scales == frozenset()


def test_a_lookup_builds_no_kernel_scales(offload_dir):
    """Layer 0's token table is looked up by row (the stored meta): no scales built for it."""
    with Engine(_rc(offload_dir)) as eng:
        tensors, _ = eng.weights.load_layer(0, torch.device("cpu"), torch.float32, "decode")
        table = tensors["model.decoder.embed_tokens.weight"]
        assert isinstance(table, PackedWeight) and not table.kernel and table.scales_zeros is None
        eng.weights.release(tensors)


@pytest.mark.parametrize("torch_kernel", [True, False])
def test_streamed_weights_build_scales_only_for_torchs_kernel(offload_dir, monkeypatch, torch_kernel):
    """A 4-bit weight read from disk at each load (no kept scales) builds the kernel's scales at its first product
    by torch's int4 kernel, none where compress/int4_rows.py's product from the packed bytes runs; the bytes the
    load charges count them either way (PackedWeight.nbytes), and the product equals that of scales built at once."""
    from flexh2o.compress import int4_rows
    if not torch_kernel and not int4_rows.kind():  # torch's generic build packs another order; no C compiler
        pytest.skip("compress/int4_rows.py's product does not run on this build (int4_rows.kind() == 0)")
    rc = _rc(offload_dir, (0, 0, 100, 0))
    name = "model.decoder.layers.0.fc1.weight"
    x = torch.randn(3, 1, TINY.hidden, generator=torch.Generator().manual_seed(0))  # (b, 1, h): a decode step
    with Engine(rc) as eng:
        tensors, _ = eng.weights.load_layer(1, torch.device("cpu"), torch.float32, "decode")
        w = tensors[name]
        ct = eng.weights.tiers[name].load_compressed(eng.weights.handles[name], torch.device("cpu"))
        eager = PackedWeight.from_stored(ct)  # scales built at once
        assert w.kernel and w.scales_zeros is None and w.nbytes() == eager.nbytes()
        monkeypatch.setattr(int4_rows, "chosen", lambda *a: not torch_kernel)
        got, want = w.linear(x), eager.linear(x)
        eng.weights.release(tensors)
    assert torch.equal(got, want) and w.nbytes() == eager.nbytes()
    if torch_kernel:
        assert torch.equal(w.scales_zeros, kernel_scales(ct.meta))
    else:
        assert w.scales_zeros is None
