"""A tiny llama GGUF file written with the gguf package: seeded weights quantized by gguf.quants (Q4_0, Q4_1,
Q8_0) and raw Q4_K blocks, for tests of the kept blocks (weights/blocks.py)."""
from __future__ import annotations

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 256, 2, 4, 2, 512, 320
TYPES = {"attn_q": "Q4_1", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_1", "ffn_gate": "Q4_1",
         "ffn_up": "Q4_0", "ffn_down": "Q4_K"}


def random_blocks(kind: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw blocks of a GGUF type (rows, bytes per row): random levels and sub-scales, fp16 scales near 1e-2."""
    import gguf
    block, size = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, kind)]
    raw = rng.integers(0, 256, (rows, k // block, size), dtype=np.uint8)
    halves = {"Q4_0": 1, "Q4_1": 2, "Q8_0": 1, "Q4_K": 2}[kind]  # fp16 fields at the start of a block
    scales = (rng.uniform(-2e-2, 2e-2, (rows, k // block, halves))).astype(np.float16)
    if kind == "Q4_K":
        scales = np.abs(scales) / 8
    raw[..., :2 * halves] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


def write_tiny_gguf(path: str, seed: int = 0, extra=None) -> str:
    """A 2-layer llama GGUF (hidden 256, GQA 4/2 heads, ffn 512, tied embeddings in Q8_0) at `path`; extra(writer),
    if given, adds metadata or tensors before the file is written."""
    import gguf
    from gguf.quants import quantize
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", LAYERS), ("embedding_length", HIDDEN), ("feed_forward_length", FFN),
                       ("attention.head_count", HEADS), ("attention.head_count_kv", KV_HEADS),
                       ("context_length", 256), ("vocab_size", VOCAB)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    head_dim = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
              "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN),
              "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}

    def add(name: str, kind: str, shape: tuple) -> None:
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        if kind == "Q4_K":
            w.add_tensor(name, random_blocks(kind, *shape, rng), raw_dtype=qtype)
            return
        values = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        w.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", "Q8_0", (VOCAB, HIDDEN))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    for i in range(LAYERS):
        for part in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{part}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        for part, kind in TYPES.items():
            add(f"blk.{i}.{part}.weight", kind, shapes[part])
    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
