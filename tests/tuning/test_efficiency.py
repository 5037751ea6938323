"""A step's work against the machine's limits (tuning/efficiency.py, metrics.efficiency): the FLOPs and bytes of
one step counted by hand on a tiny OPT, and the percentages of the profile's peaks they give."""
from __future__ import annotations

import pytest
import torch

from flexh2o.config import ModelConfig
from flexh2o.kv.spec import Budget, KVSpec
from flexh2o.metrics import efficiency, efficiency_line
from flexh2o.placement import Percent
from flexh2o.run_config import RunConfig
from flexh2o.tuning.efficiency import decode_matmuls, peaks, step_bytes, step_flops, step_work

TINY = ModelConfig("tiny", "opt", hidden=64, num_layers=2, num_heads=4, ffn=256, vocab=512, max_positions=64)
BLOCK = 4 * 64 * 64 + 2 * 64 * 256  # a decoder layer's matmul weights: q, k, v, out (h x h), fc1, fc2 (h x ffn)
HEAD = 512 * 64  # the tied vocabulary head


def _rc(percent="100 0 100 0", **kw) -> RunConfig:
    base = dict(model=TINY, percent=Percent.parse(percent.split()), gpu_batch_size=3, num_gpu_batches=2,
                prompt_len=8, gen_len=4, dtype=torch.float32, compute_dtype=torch.float32)
    return RunConfig(**{**base, **kw})


def test_flops_by_hand():
    """6 sequences, prompt 8, full cache of 8 + 4 slots, 4 heads of 16: prefill multiplies every token by both
    blocks and the last token by the head, and attends t (t + 1) / 2 causal pairs at 4 x 16 FLOPs; decode one
    token, against every slot of the block."""
    n, t, heads, d = 6, 8, 4, 16
    prefill = 2 * n * (t * 2 * BLOCK + HEAD) + 2 * n * heads * 4 * d * t * (t + 1) // 2
    decode = 2 * n * (2 * BLOCK + HEAD) + 2 * n * heads * 4 * d * (8 + 4)
    assert step_flops(_rc(), prefill=True) == prefill == 9_940_992
    assert step_flops(_rc(), prefill=False) == decode == 1_609_728


def test_decode_matmuls_by_hand():
    """Per GPU batch (2): each block's q, k, v, out (64 x 64), fc1 (256 x 64), fc2 (64 x 256), and the tied head
    (512 x 64); the embedding's tables are looked up, not multiplied. At 3 rows each they are step_flops' matmuls."""
    got = decode_matmuls(_rc())
    assert got == {(64, 64): 2 * 2 * 4, (256, 64): 2 * 2, (64, 256): 2 * 2, (512, 64): 2}
    attention = 2 * 6 * 4 * 4 * 16 * (8 + 4)
    assert sum(2 * 3 * n * k * c for (n, k), c in got.items()) + attention == step_flops(_rc(), False)


def test_h2o_decode_attends_its_budget():
    """h2o with 2 heavy + 2 recent: a block holds fewer slots than the full cache's 12, the decode attention
    follows them."""
    rc = _rc(kv=KVSpec("h2o", Budget(2, 2)))
    slots = rc.cache_slots()
    assert slots < 12
    assert step_flops(rc, False) == 2 * 6 * (2 * BLOCK + HEAD) + 2 * 6 * 4 * 4 * 16 * slots


def test_bytes_by_hand():
    """fp16 storage, fp32 compute, everything on disk: the weights are read once a step (2 bytes an element, the
    tied table once for the embedding and once for the head, as each layer's load reads it); memory reads are the
    matmul weights in fp32 once per GPU batch, plus (decode) every cache block; the cache is written at prefill
    and read and written back at each decode step."""
    rc = _rc("0 0 0 0", dtype=torch.float16)
    embed = 512 * 64 + (64 + 2) * 64  # token and position tables
    block = BLOCK + 4 * 64 + 4 * 64 + 256 + 64  # matmul weights, their 4 biases of h, 2 norms of (w, b), fc biases
    head = 2 * 64 + HEAD  # final norm (w, b) and the tied table
    weights = (embed + 2 * block + head) * 2
    # a block of 3 rows, 4 KV heads, 8 + 4 slots of 16: K and V in fp16, positions int64, scores fp32
    cache = 2 * 2 * (3 * 4 * 12 * (2 * 16 * 2 + 8 + 4))  # 2 layers x 2 GPU batches
    got_p, got_d = step_bytes(rc, True), step_bytes(rc, False)
    assert got_p["disk"] == weights + cache == 383_488 and got_d["disk"] == weights + 2 * cache
    assert got_p["mem"] == (2 * BLOCK + HEAD) * 4 * 2 == 1_048_576 and got_d["mem"] == got_p["mem"] + cache
    assert got_p["h2d"] == got_d["h2d"] == 0  # a CPU run: nothing crosses to a device


def test_percentages_of_the_peaks():
    """A profile with a 10 GFLOP/s matmul peak (the largest of its rows) and 2 GB/s memory: a 1 s decode step of
    5 GFLOP and 1 GB is at 50% of each."""
    hw = {"name": "t", "matmul_flops": {"float32": 4e9}, "matmul_flops_by_rows": {"float32": {"1": 1e9, "64": 1e10}},
          "cpu_mem_bw": 2e9, "disk_read_bw": 1e9}
    rc = _rc()
    assert peaks(rc, hw)["decode"] == 1e10 and peaks(rc, hw)["mem"] == 2e9
    work = {"decode": {"flops": 5e9, "bytes": {"disk": 0.0, "h2d": 0.0, "mem": 1e9}, "dtype": "float32"},
            "peaks": peaks(rc, hw)}
    got = efficiency(work, {"decode": 1.0})["decode"]
    assert got["matmul_peak_pct"] == pytest.approx(50.0) and got["mem_pct"] == pytest.approx(50.0)
    assert "disk_pct" not in got  # nothing read from disk
    line = efficiency_line(efficiency(work, {"decode": 1.0}), work)
    assert "decode 5 GFLOP/step at 5 GFLOP/s = 50% of float32's matmul peak, mem 50%" in line
    assert set(step_work(rc, hw)) == {"prefill", "decode", "peaks"} and "peaks" not in step_work(rc, None)
