"""GGUF's quantized blocks (Q4_0, Q4_1, Q8_0, Q4_K) kept as they are (weights/blocks.py): bit-exact against the
gguf package's own dequantization, stored and counted at their own bytes, and run by the engine (the int4 kernel or
the expand path) with logits equal to the same weights expanded to fp32 (generic: fp32 summation order; the kernel:
its bf16 activations, scales and zeros)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from flexh2o.compress.codec import CompressedTensor, CompressionSpec, dequantize, stored_bytes, weight_spec
from flexh2o.compress.kept import KeptBlocks, with_kept
from flexh2o.engine import Engine
from flexh2o.placement import Percent
from flexh2o.run_config import RunConfig, opened_with_kept
from flexh2o.sampling import TeacherForcer
from flexh2o.weights import blocks
from flexh2o.weights.convert import convert
from flexh2o.weights.format import CheckpointReader

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from tiny_gguf import HEADS, HIDDEN, TYPES, random_blocks, write_tiny_gguf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
KINDS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, but for the sign of a zero (Q4_0's d * (8 - 8) is -0 where d < 0; the codec's 8 d - 8 d is +0)."""
    nonzero = b != 0
    return a.shape == b.shape and torch.equal(a, b) and torch.equal(a[nonzero].view(torch.int32),
                                                                    b[nonzero].view(torch.int32))


def _reference(raw: np.ndarray, kind: str) -> torch.Tensor:
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    return torch.from_numpy(np.array(gguf_dequantize(raw, qtype), dtype=np.float32))


@pytest.mark.parametrize("kind", KINDS)
def test_random_blocks_dequantize_bit_exact(kind):
    """Random levels and scales of every kept type: the codec's expansion equals gguf.quants.dequantize bit for
    bit, and the kept bytes are the block's (Q4_1: 20 bytes per 32 values, Q8_0: 36 for GGUF's 34)."""
    rng = np.random.default_rng(3)
    rows, k = 64, 512
    raw = random_blocks(kind, rows, k, rng)
    ct = blocks.from_gguf(raw, kind, (rows, k))
    assert ct.shape == (rows, k) and ct.spec == blocks.kept_spec(kind)
    assert _same_bits(dequantize(ct, torch.float32), _reference(raw, kind))
    per_32 = {"Q4_0": 20, "Q4_1": 20, "Q8_0": 36, "Q4_K": 24}[kind]  # Q4_K: fp32 scale and minimum per 32
    assert ct.nbytes == stored_bytes((rows, k), torch.float32, ct.spec) == rows * k // 32 * per_32


def test_nibble_order_is_ggml():
    """One Q4_1 block with d = 1, m = 0 and distinct nibbles: value j is byte j's low nibble, j + 16 its high."""
    raw = np.zeros((1, 20), dtype=np.uint8)
    raw[0, :2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    raw[0, 4:] = np.arange(16, dtype=np.uint8) | ((15 - np.arange(16, dtype=np.uint8)) << 4)
    got = dequantize(blocks.from_gguf(raw, "Q4_1", (1, 32)), torch.float32)[0]
    assert got.tolist() == list(range(16)) + list(range(15, -1, -1))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """The tiny GGUF converted with its blocks kept and expanded to fp32."""
    root = tmp_path_factory.mktemp("tiny_gguf")
    src = write_tiny_gguf(str(root / "tiny.gguf"))
    out = {"src": src, "kept": str(root / "kept"), "fp32": str(root / "fp32")}
    convert(src, out["kept"], "float32", keep_blocks=True)
    convert(src, out["fp32"], "float32")
    return out


def test_checkpoint_keeps_blocks(tiny):
    """Every quantized tensor is stored in its blocks (data + fp16/fp32 meta, one checksummed file) and reads back
    as the CompressedTensor whose expansion is the fp32 conversion's tensor; norms stay plain."""
    kept, fp32 = CheckpointReader(tiny["kept"]), CheckpointReader(tiny["fp32"])
    specs = kept.kept()
    assert set(specs) == {n for n in fp32.names() if len(fp32.shape(n)) == 2}
    for name in fp32.names():
        got = kept.read(name)
        if name in specs:
            assert isinstance(got, CompressedTensor) and got.spec == specs[name]
            assert _same_bits(dequantize(got, torch.float32), fp32.read(name)), name
        else:
            assert _same_bits(got, fp32.read(name))
    assert specs["model.layers.0.mlp.down_proj.weight"].scale_dtype == torch.float32  # Q4_K
    assert specs["model.embed_tokens.weight"].bits == 8  # Q8_0


def test_corrupt_kept_file_refused(tiny, tmp_path):
    import shutil
    dst = str(tmp_path / "c")
    shutil.copytree(tiny["kept"], dst)
    reader = CheckpointReader(dst)
    path = reader.file_of("model.layers.1.self_attn.q_proj.weight")
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) - 3)  # inside the meta (scales)
        fh.write(b"\x00\x7c\x00")
    with pytest.raises(ValueError, match="checksum"):
        CheckpointReader(dst).read("model.layers.1.self_attn.q_proj.weight")
    with open(os.path.join(dst, "index.json")) as fh:
        index = json.load(fh)
    index["tensors"]["model.layers.1.self_attn.q_proj.weight"]["blocks"]["bits"] = 3
    with open(os.path.join(dst, "index.json"), "w") as fh:
        json.dump(index, fh)
    with pytest.raises(ValueError, match="malformed"):
        CheckpointReader(dst)


def test_run_spec_and_plan_bytes(tiny):
    """The run's weight compression: each kept tensor's own spec (whatever --compress-group-size says), plain
    tensors plain without --compress-weight; the plan counts the checkpoint's bytes, but for the 8-bit head (the
    tied Q8_0 embedding here), stored plain in fp32 (weights/kept_run.py; this test expected its blocks before)."""
    reader = CheckpointReader(tiny["kept"])
    run = opened_with_kept(tiny["kept"], None, None)[1]  # as flexh2o-run and the eval open a run's checkpoint
    assert isinstance(run, KeptBlocks) and not run.others
    flags = opened_with_kept(tiny["kept"], None, CompressionSpec(4, 64, 1))[1]
    head = "model.embed_tokens.weight"
    for name in reader.names():
        shape = reader.shape(name)
        want = None if name == head else reader.kept().get(name)
        assert weight_spec(shape, run, name) == weight_spec(shape, flags, name) == want
    assert opened_with_kept(tiny["fp32"], None, None)[1] is None and with_kept(None, {}) is None
    rc = _rc(tiny["kept"], "generic")
    homes = rc.placement.weights
    assert sum(homes.bytes_by_tier(rc.dtype, rc.compress_weight).values()) == sum(
        e["nbytes"] for n, e in reader.entries.items() if n != head) + 4 * int(np.prod(reader.shape(head)))


def _rc(path: str, mode: str, prompt_len: int = 24, gen_len: int = 6) -> RunConfig:
    checkpoint, kept = opened_with_kept(path, None, None)
    return RunConfig(model=checkpoint.config, percent=Percent(100, 0, 100, 0, 100, 0), gpu_batch_size=2,
                     prompt_len=prompt_len, gen_len=gen_len, dtype=torch.float32, path=path, gpu_mem=2 << 30,
                     compress_weight=kept, checkpoint=checkpoint, weight_kernel=mode)


def _forced_logits(rc: RunConfig, prompts: list, targets: torch.Tensor) -> tuple:
    with Engine(rc) as eng:
        gen = eng.generate(prompts, targets.shape[1], sampler=TeacherForcer(targets), record_logits=True)
        return torch.stack(gen.step_logits, 1), eng.kernel, eng.weights.kernel_order


@pytest.mark.parametrize("mode", ["generic", "int4"])
def test_engine_kept_blocks_equal_expanded_fp32(tiny, mode):
    """Kept blocks vs the same weights expanded to fp32, teacher-forced on the same tokens: generic within fp32
    summation order; the int4 kernel (the 4-bit blocks of 32 rows' multiples) within its bf16 rounding."""
    g = torch.Generator().manual_seed(0)
    rc = _rc(tiny["fp32"], "generic")
    prompts = torch.randint(0, rc.model.vocab, (2, 24), generator=g).tolist()
    targets = torch.randint(0, rc.model.vocab, (2, 6), generator=g)
    want, _, _ = _forced_logits(rc.with_(compress_weight=None), prompts, targets)
    got, kernel, ordered = _forced_logits(_rc(tiny["kept"], mode), prompts, targets)
    assert kernel == dict.fromkeys(("prefill", "decode"), mode == "int4")
    four_bit = {f"model.layers.{i}.{p}" for i in range(2) for p in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
        "mlp.up_proj.weight", "mlp.down_proj.weight")}
    assert ordered == four_bit  # Q4_0/Q4_1/Q4_K in the kernel's order; Q8_0 (v_proj, embeddings) expanded
    if mode == "generic":
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:  # bf16 activations, scales and zeros through a random model (measured: max 0.15, mean 0.019 of 5.7)
        scale, err = float(want.abs().max()), (got - want).abs()
        torch.testing.assert_close(got, want, atol=scale * 2 ** -5, rtol=2 ** -5)
        assert float(err.mean()) < float(want.std()) * 2 ** -5  # a wrong level or zero would be O(std)
        assert err.max() > 1e-6  # the kernel really ran


@pytest.mark.eval
def test_smollm2_tensors_bit_exact():
    """Every Q4_1 / Q8_0 tensor of the real SmolLM2 GGUF: kept blocks expand bit-exactly to gguf's dequantize."""
    from flexh2o.eval.common import smollm2_gguf
    try:
        path = smollm2_gguf()
    except ValueError as e:
        pytest.skip(str(e))
    kinds = {}
    for t in gguf.GGUFReader(path).tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        if blocks.keeps(t.tensor_type.name, shape):
            ct = blocks.from_gguf(t.data, t.tensor_type.name, shape)
            assert _same_bits(dequantize(ct, torch.float32), _reference(t.data, t.tensor_type.name)), t.name
            kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    assert kinds == {"Q4_1": 210, "Q8_0": 1}


def test_types_cover_every_kept_kind():
    assert set(TYPES.values()) | {"Q8_0"} == set(KINDS) == set(blocks.KEPT)


@pytest.mark.parametrize("what", ["rope_freqs", "yarn"])
def test_gguf_rope_scaling_is_refused_not_ignored(tmp_path, what):
    """A Llama 3.1 GGUF carries its rope scaling as a rope_freqs tensor (or a scaling type in the metadata) that
    the GGUF reader does not apply: conversion refuses it in one line, naming the Hugging Face route, and writes
    nothing."""
    def extra(w):
        if what == "rope_freqs":
            w.add_tensor("rope_freqs.weight", np.ones(HIDDEN // HEADS // 2, dtype=np.float32))
        else:
            w.add_string("llama.rope.scaling.type", "yarn")
    src = write_tiny_gguf(str(tmp_path / "scaled.gguf"), extra=extra)
    dst = tmp_path / "out"
    with pytest.raises(ValueError, match="rope scaling .*Hugging Face folder") as e:
        convert(src, str(dst))
    assert "\n" not in str(e.value)
    assert not dst.exists() or not any(dst.iterdir())


def test_gguf_linear_rope_scaling_is_read(tmp_path):
    def extra(w):
        w.add_string("llama.rope.scaling.type", "linear")
        w.add_float32("llama.rope.scaling.factor", 4.0)
    src = write_tiny_gguf(str(tmp_path / "linear.gguf"), extra=extra)
    convert(src, str(tmp_path / "out"))
    cfg = CheckpointReader(str(tmp_path / "out")).config
    assert (cfg.rope_type, cfg.rope_factor) == ("linear", 4.0)


def test_head_expanded_once(tiny):
    """The 8-bit head (tied Q8_0 embedding) is stored plain in its home tier, holding exactly its blocks' values,
    and no load expands it again: the head layer's and layer 0's loads hand out the home tensor itself."""
    rc = _rc(tiny["kept"], "generic")
    head = "model.embed_tokens.weight"
    want = dequantize(CheckpointReader(tiny["kept"]).read(head), torch.float32)
    with Engine(rc) as eng:
        store = eng.weights
        assert head not in store.kernel_order and _same_bits(store.tensor(head), want)
        for layer in (0, len(store.specs) - 1):
            tensors, copied = store.load_layer(layer, "cpu", torch.float32, "decode")
            assert tensors[head].data_ptr() == store.handles[head].data_ptr()
            store.release(tensors)
