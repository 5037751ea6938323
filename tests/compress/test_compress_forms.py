"""Where the int4 kernel runs, the memory plan reserves only what each phase really expands (weights/forms.py):
the bytes the engine's weight loads copy equal the plan's per-layer figures, the largest batch follows, and under
--weight-kernel auto a phase is expanded only where the plan still fits it."""
from __future__ import annotations

import pytest
import torch

from flexh2o.compress import CompressionSpec
from flexh2o.compress.choice import PHASES, forced_by_memory
from flexh2o.compress.kernels import PackedWeight, rows_buffer_bytes
from flexh2o.config import ModelConfig, from_name
from flexh2o.engine import Engine
from flexh2o.placement import Percent
from flexh2o.planning.memory_plan import largest_batch, plan_memory
from flexh2o.run_config import RunConfig
from flexh2o.weights.forms import WeightForms

# vocab a multiple of 32: the token table is kept in the kernel's order, 130 positions are not (codec order); a
# wide MLP makes an expanded block the largest layer
TINY = ModelConfig("tiny32", "opt", hidden=64, num_layers=2, num_heads=4, ffn=1024, vocab=1024, max_positions=128)
W1, C4 = CompressionSpec(4, 64, 1), CompressionSpec(4, 64, -1)
KERNELS = {"both": {"prefill": True, "decode": True}, "decode": {"prefill": False, "decode": True},
           "none": {"prefill": False, "decode": False}}

pytestmark = pytest.mark.usefixtures("one_thread")


def _forms(rc, kernel: dict) -> WeightForms:
    """rc's WeightForms with the int4 kernel at the phases `kernel` (phase -> bool) names."""
    return WeightForms.of_run(rc, [p for p, on in kernel.items() if on])


def _rc(offload_dir, **kw) -> RunConfig:
    base = dict(model=TINY, percent=Percent.parse([0, 100, 100, 0]), gpu_batch_size=3, prompt_len=10, gen_len=4,
                dtype=torch.float16, offload_dir=offload_dir, compress_weight=W1, weight_kernel="int4")
    return RunConfig(**{**base, **kw})


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_plan_counts_what_the_weight_loads_copy(offload_dir, kernel):
    """Per layer and phase, the bytes load_layer charges to the compute side are the plan's figure (the block
    buffer of lookups and block-by-block matmuls is reserved on top: it is transient, not charged); the head runs
    the kernel where decode does, lookups stay packed."""
    rc = _rc(offload_dir)
    with Engine(rc) as eng:
        eng.weights.forms = _forms(rc, KERNELS[kernel])  # the loads take the weights as these forms say
        for phase, step in (("prefill", 0), ("decode", 1)):
            want = _forms(rc, KERNELS[kernel]).compute_side_bytes(rc.placement.weights, phase)
            for layer, specs in enumerate(rc.placement.weights.layer_specs):
                tensors, copied = eng.weights.load_layer(layer, torch.device("cpu"), rc.compute_at(step), phase)
                rows = sum(rows_buffer_bytes(s.shape) for s in specs  # lookups and block-by-block matmuls
                           if isinstance(tensors[s.name], PackedWeight) and not tensors[s.name].kernel)
                assert copied + rows == want[layer], (phase, layer)
                assert _packed(tensors) == _want_packed(layer, KERNELS[kernel], phase), (phase, layer)
                if layer > TINY.num_layers:
                    assert tensors["model.decoder.embed_tokens.weight"].kernel == KERNELS[kernel]["decode"]
                eng.weights.release(tensors)


def _packed(tensors: dict) -> set:
    return {name.split(".")[-2] for name, t in tensors.items() if isinstance(t, PackedWeight)}


def _want_packed(layer: int, kernel: dict, phase: str) -> set:
    """Lookups always, the head's table as decode, the blocks' matmuls as their phase (positions: codec order)."""
    if layer == 0:
        return {"embed_tokens"}
    if layer > TINY.num_layers:
        return {"embed_tokens"}  # run by the kernel where decode runs it, else block by block
    return {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"} if kernel[phase] else set()


def _big(weight_kernel="auto", spec=W1, **kw) -> RunConfig:
    """opt-350m streamed from disk under a small --gpu-mem (its tied vocab table dominates an expanded layer)."""
    return RunConfig(model=from_name("opt-350m"), percent=Percent.parse([0, 0, 100, 0]), prompt_len=32, gen_len=16,
                     dtype=torch.float16, gpu_mem=400 << 20, cpu_mem=8 << 30, compress_weight=spec,
                     compress_cache=C4, weight_kernel=weight_kernel, **kw)


def test_buffers_shrink_where_the_kernel_runs_and_the_largest_batch_follows():
    rc = _big()
    buffers = {k: plan_memory(rc, forms=_forms(rc, v)).bytes["gpu"]["buffers"] for k, v in KERNELS.items()}
    assert buffers["both"] < buffers["decode"] <= buffers["none"]
    # auto plans room to expand at both phases (the probe may choose either), int4 only the kernel's bytes
    assert plan_memory(rc).bytes == plan_memory(rc, forms=_forms(rc, KERNELS["none"])).bytes
    assert plan_memory(_big("int4")).bytes == plan_memory(rc, forms=_forms(rc, KERNELS["both"])).bytes
    assert plan_memory(_big("generic")).bytes == plan_memory(rc, forms=_forms(rc, KERNELS["none"])).bytes
    block = 4 * 1024 * 1024 + 2 * 1024 * 4096  # an opt-350m block's matmul weights, the largest expanded layer
    # two fp32 copies of a block in flight vs two of layer 0 (its packed table, row buffer, 2050 positions in fp32)
    assert buffers["none"] - buffers["both"] > 0.4 * 2 * block * 4
    batches = {name: largest_batch(r) for name, r in (
        ("int4", _big("int4")), ("auto", rc), ("off", _big("generic", CompressionSpec(4, 64, 0))),
        ("plain", _big("generic", None).with_(compress_cache=None)))}
    # off expands the 50272 x 512 vocab table whole (twice in flight); auto's head and lookups go by blocks
    assert batches["int4"] > batches["auto"] > 1.5 * batches["off"] > 0, batches  # 114 > 98 > 1.5 x 51
    # 36 uncompressed converting whole layers (26 while its fp16 vocab table was converted whole to fp32:
    # weights/stored_form.py); the plain run's own plan converts its matmul weights on use there, which fits more
    plain = _big("generic", None).with_(compress_cache=None)
    whole = largest_batch(plain, plan_of=lambda r: plan_memory(r, forms=WeightForms.planned(r)))
    assert batches["auto"] > 2.5 * whole > 0 and batches["plain"] > whole, (batches, whole)


def test_forced_by_memory_puts_the_kernel_where_expanding_does_not_fit():
    faster = {"prefill": False, "decode": False}
    assert forced_by_memory(faster, lambda k: True) == faster
    assert forced_by_memory(faster, lambda k: k["prefill"]) == {"prefill": True, "decode": False}
    assert forced_by_memory(faster, lambda k: all(k.values())) == {"prefill": True, "decode": True}
    assert forced_by_memory({"prefill": False, "decode": True}, lambda k: k["prefill"]) == KERNELS["both"]


def test_auto_expands_a_phase_only_where_the_plan_fits(offload_dir, monkeypatch, tmp_path):
    """The probe finds expanding faster at both phases; the engine expands where the plan fits, else runs the
    kernel, and its plan is the one of the phases it runs."""
    from flexh2o.compress import choice
    monkeypatch.setenv("FLEXH2O_CACHE_DIR", str(tmp_path))  # the fake timings are cached apart from other tests'
    monkeypatch.setattr(choice, "probe", lambda *a: {p: {"int4": 2.0, "generic": 1.0} for p in PHASES})
    rc = _rc(offload_dir, weight_kernel="auto")
    tight = plan_memory(rc, forms=_forms(rc, KERNELS["both"])).total("gpu")
    assert plan_memory(rc.with_(gpu_mem=tight), forms=_forms(rc, KERNELS["decode"])).overflow()  # expanding: no fit
    for gpu_mem, want in ((tight, KERNELS["both"]), (64 << 20, KERNELS["none"])):
        with Engine(rc.with_(gpu_mem=gpu_mem)) as eng:
            assert eng.kernel == want
            assert eng.plan.bytes == plan_memory(rc.with_(gpu_mem=gpu_mem), forms=_forms(rc, want)).bytes
            eng.generate([[5, 6, 7], [8, 9], [10]], 3)  # runs within the plan of its phases


def test_plan_counts_the_compressed_reads_of_disk_weights_expanded_whole(offload_dir, monkeypatch):
    """Weights on disk expanded whole (no kernel) are read compressed into fresh buffers, a layer's at once, held
    until its load ends, two loads at once (the schedule's two I/O threads): the live bytes of those reads,
    measured through a run, peak at the plan's two layers (their logical bytes: the plan leaves the direct-I/O
    padding out, a few KiB a read, as for every disk read)."""
    import threading
    import weakref
    from flexh2o.compress.tier import CompressedTier
    rc = _rc(offload_dir, percent=Percent.parse([0, 0, 100, 0]), weight_kernel="generic")
    lock, live, peak = threading.Lock(), [0], [0]
    load = CompressedTier.load_compressed

    def counted(self, handle, device, bufs=None):
        ct = load(self, handle, device, bufs)
        if bufs is None:  # a fresh read (the arenas' reads are counted with the layers in flight)
            for t in (ct.data, ct.meta):
                n = t.nbytes
                with lock:
                    live[0] += n
                    peak[0] = max(peak[0], live[0])
                weakref.finalize(t.untyped_storage(), _gone, lock, live, n)
        return ct
    monkeypatch.setattr(CompressedTier, "load_compressed", counted)
    with Engine(rc) as eng:
        assert eng.kernel == KERNELS["none"]
        planned = max(max(eng.forms.expanded_read_bytes(rc.placement.weights, p)) for p in PHASES)
        eng.generate([[5, 6, 7], [8, 9], [10]], 3)
    layer = max(sum(w.stored for s, w in zip(specs, forms) if w.spec is not None)
                for specs, forms in zip(rc.placement.weights.layer_specs, eng.forms.table(rc.placement.weights)))
    # a layer's reads are all alive at its load's end; two loads overlap or not as the threads run (2x seen here)
    assert 0 < planned == layer <= peak[0] <= 2 * planned


def _gone(lock, live, n):
    with lock:
        live[0] -= n
