"""Large embedding and head tables reach the compute side in their stored dtype (weights/stored_form.py): a lookup
converts the rows it gathers (exactly what converting the whole table gives), the head converts a chunk of rows
at a time (each output the same dot product as one call, up to the order of its sum), the engine's weight loads
copy what the memory plan reserves, and opt-1.3b's compute-side buffers in fp32 stop being sized by its vocabulary
table in fp32 (the read arenas of its streamed weights counted beside them). A table homed on the disk tier of a CPU
run is read from its file by rows and chunks (a DiskTable: the same values as the table read whole), so the read
arenas are sized by a decoder layer."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexh2o.compress.choice import PHASES
from flexh2o.config import ModelConfig, from_name
from flexh2o.engine import Engine
from flexh2o.models import common, opt
from flexh2o.models.common import StoredWeight
from flexh2o.placement import Percent
from flexh2o.planning.memory_plan import in_flight_bytes, largest_batch, plan_memory
from flexh2o.run_config import RunConfig
from flexh2o.storage.disk import DiskTier
from flexh2o.units import ALIGN, padded
from flexh2o.weights.forms import WeightForms
from flexh2o.weights.stored_form import DiskTable

TINY = ModelConfig("tiny", "opt", hidden=64, num_layers=2, num_heads=4, ffn=256, vocab=512, max_positions=64)
SMALL_CHUNK = 40 * 64 * 4  # 40 rows of a 64-wide fp32 table: TINY's tables (512 x 64, 66 x 64) span chunks
U32 = 2.0 ** -24  # fp32 unit roundoff

pytestmark = pytest.mark.usefixtures("one_thread")


def _dot_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per output, twice the bound on one fp32 K-term dot product's rounding (gamma_K = K u / (1 - K u) times
    sum |x_i w_i|, whatever the order of the sum), so two computations of it differ by at most this."""
    k = x.shape[-1]
    gamma = k * U32 / (1 - k * U32)
    return 2 * gamma * (x.double().abs() @ w.double().abs().t())


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16])
def test_a_gathered_lookup_equals_the_converted_table(storage):
    """Gathering then converting is the same elementwise conversion of the same values: bit-equal."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1000, 48, generator=g) * 0.02).to(storage)
    ids = torch.randint(0, 1000, (3, 7), generator=g)
    got = StoredWeight(w, torch.float32).rows(ids)
    assert got.dtype == torch.float32 and torch.equal(got, F.embedding(ids, w.float()))  # (3, 7, 48)


@pytest.mark.parametrize("rows", [1, 5, 64, 130])
@pytest.mark.parametrize("chunk", [SMALL_CHUNK, 1 << 23])
def test_a_chunked_head_equals_one_call_up_to_the_sum_order(monkeypatch, rows, chunk):
    """x (rows, K) fp32 against a bf16 (N, K) table converted chunk by chunk: within _dot_bound of one F.linear on
    the whole converted table (the chunks change only which BLAS kernel sums each dot product); with a bias too."""
    monkeypatch.setattr(common, "STORED_CHUNK_BYTES", chunk)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1001, 64, generator=g).to(torch.bfloat16)  # 1001: the last chunk is shorter
    x, bias = torch.randn(rows, 64, generator=g), torch.randn(1001, generator=g)
    ref = F.linear(x, w.float())
    got = StoredWeight(w, torch.float32).linear(x)
    assert got.shape == (rows, 1001) and got.dtype == torch.float32
    assert ((got - ref).double().abs() <= _dot_bound(x, w.float())).all()
    with_bias = StoredWeight(w, torch.float32).linear(x.view(1, rows, 64), bias)  # (1, rows, N)
    # the bias adds one rounding of the sum: |s + b| u more, on top of the dot products' bound
    slack = _dot_bound(x, w.float()) + (ref.double() + bias.double()).abs() * U32 * 2
    assert ((with_bias[0] - F.linear(x, w.float(), bias)).double().abs() <= slack).all()


@pytest.mark.parametrize("storage,width", [(torch.bfloat16, 64), (torch.float16, 48), (torch.float32, 33)])
def test_a_disk_table_reads_what_the_table_gives(monkeypatch, tmp_path, storage, width):
    """A DiskTable over the table's file: a lookup (repeated, adjacent and scattered ids, rows not aligned to the
    4096-byte spans when width * itemsize is not) bit-equal to the gathered table, and the head's chunked matmul
    bit-equal to StoredWeight's on the table held whole (the same chunks, converted and multiplied alike); it reads
    the rows' spans and the table once per matmul, never the whole table for a lookup."""
    monkeypatch.setattr(common, "STORED_CHUNK_BYTES", SMALL_CHUNK)
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(1001, width, generator=g) * 0.02).to(storage)
    tier = DiskTier(tmp_path / "disk", 1 << 30)
    try:
        h = tier.alloc(tuple(w.shape), storage)
        tier.store(h, w)
        table = DiskTable(None, torch.float32, tier, h)
        ids = torch.tensor([[5, 6, 7, 5, 1000], [0, 999, 300, 6, 2]])  # (2, 5)
        before = tier.bytes_loaded
        assert torch.equal(table.rows(ids), F.embedding(ids, w.float()))  # (2, 5, width)
        assert tier.bytes_loaded - before < w.numel() * w.element_size()  # the rows' spans only
        x = torch.randn(2, 3, width, generator=g)
        before = tier.bytes_loaded
        assert torch.equal(table.linear(x), StoredWeight(w, torch.float32).linear(x))  # (2, 3, 1001)
        assert tier.bytes_loaded - before >= w.numel() * w.element_size()
    finally:
        tier.close()


def test_opt_embed_and_head_through_stored_weights(monkeypatch):
    """TINY's embedding layer and tied head as the family computes them: the embedding bit-equal, the logits within
    the dot products' bound, against the same functions handed the tables converted whole."""
    monkeypatch.setattr(common, "STORED_CHUNK_BYTES", SMALL_CHUNK)
    g = torch.Generator().manual_seed(2)
    tok, pos = (torch.randn(s, generator=g).mul(0.02).to(torch.bfloat16) for s in ((512, 64), (66, 64)))
    ln = {f"{opt.P}final_layer_norm.{n}": torch.full((64,), v) for n, v in (("weight", 1.0), ("bias", 0.0))}
    plain = {f"{opt.P}embed_tokens.weight": tok.float(), f"{opt.P}embed_positions.weight": pos.float(), **ln}
    stored = {**plain, f"{opt.P}embed_tokens.weight": StoredWeight(tok, torch.float32),
              f"{opt.P}embed_positions.weight": StoredWeight(pos, torch.float32)}
    ids, positions = torch.randint(0, 512, (3, 5), generator=g), torch.arange(5).expand(3, 5)
    x = opt.embed(TINY, stored, ids, positions)
    assert torch.equal(x, opt.embed(TINY, plain, ids, positions))  # (3, 5, 64)
    y = F.layer_norm(x, (64,), ln[f"{opt.P}final_layer_norm.weight"], ln[f"{opt.P}final_layer_norm.bias"], 1e-5)
    got, ref = opt.head(TINY, stored, x), opt.head(TINY, plain, x)  # (3, 5, 512)
    assert ((got - ref).double().abs() <= _dot_bound(y.reshape(-1, 64), tok.float()).view(3, 5, 512)).all()


@pytest.mark.parametrize("percent", ["0 100 100 0", "100 0 100 0", "0 0 100 0", "30 30 30 30"])
def test_the_plan_reserves_what_the_loads_copy(monkeypatch, offload_dir, percent):
    """bf16 storage, fp32 compute: per layer and phase, the bytes a weight load charges plus the head's chunk
    buffer (transient, taken while it multiplies) are the plan's figure; the tables come as StoredWeights, read by
    rows and chunks from their files where they live on disk (DiskTables: nothing copied at the load, the head's
    two read chunks transient like its chunk buffer), and every other weight converted as before."""
    monkeypatch.setattr(common, "STORED_CHUNK_BYTES", SMALL_CHUNK)
    rc = RunConfig(model=TINY, percent=Percent.parse(percent.split()), gpu_batch_size=2, prompt_len=8, gen_len=2,
                   dtype=torch.bfloat16, compute_dtype=torch.float32, offload_dir=offload_dir)
    chunk = 40 * 64 * 4  # SMALL_CHUNK's 40 rows of the 64-wide head table in fp32
    with Engine(rc) as eng:
        for phase in ("prefill", "decode"):
            want = WeightForms.of_run(rc).compute_side_bytes(rc.placement.weights, phase)
            for layer, specs in enumerate(rc.placement.weights.layer_specs):
                tensors, copied = eng.weights.load_layer(layer, torch.device("cpu"), torch.float32, phase)
                kept = {s.name for s in specs if isinstance(tensors[s.name], StoredWeight)}
                big = {s.name for s in specs if len(s.shape) == 2 and layer in (0, TINY.num_layers + 1)}
                assert kept == big, layer
                tables = {s.name for s in specs if isinstance(tensors[s.name], DiskTable)}
                assert tables == {s for s in kept if rc.placement.weights[s] == "disk"}, layer
                reads = 2 * (padded(40 * 64 * 2) + ALIGN) if tables and layer > TINY.num_layers else 0
                assert copied + (chunk if layer > TINY.num_layers else 0) + reads == want[layer], (phase, layer)
                assert copied == sum(s.numel * 4 for s in specs if s.name not in kept), layer
                eng.weights.release(tensors)


CAP = dict(gpu_mem=503514729, cpu_mem=55946082, disk_mem=100 << 30)
MiB = 1 << 20


def _whole(rc):
    """rc's plan converting whole layers at each load (no weight converted on use)."""
    return plan_memory(rc, forms=WeightForms.planned(rc))


def test_opt13b_streamed_in_fp32_is_sized_by_a_decoder_layer_and_the_read_arenas():
    """opt-1.3b streamed from disk in bf16, computed in fp32: the weights in flight are the two read arenas of the
    largest streamed layer (a decoder block in bf16: the embedding layer's tables are read by rows, the head's in
    chunks) and two decoder blocks converted to fp32 (12 h^2 + 13 h elements each), not two 50272 x 2048 tables
    converted to fp32 (393 MiB each) nor two arenas of the bf16 tables (204 MiB each); so 600 MiB of gpu tier, which
    the whole-table sizing overflowed (830 MiB of buffers), fits a batch, and ~480 MiB does not (the arenas and
    converted blocks alone are 577 MiB). There the plan converts the blocks' matmul weights on use instead
    (weights/on_use.py): the arenas, the head's peak, a block's 1-D weights in fp32 and one 8 MiB chunk buffer."""
    cfg = from_name("opt-1.3b")
    rc = RunConfig(model=cfg, percent=Percent.parse([0, 0, 0, 0, 0, 100]), gpu_batch_size=1, prompt_len=128,
                   gen_len=32, dtype=torch.bfloat16, compute_dtype=torch.float32, **CAP)
    h, f = cfg.hidden, cfg.ffn
    block = (4 * h * h + 2 * h * f + 4 * h + f + h + 4 * h) * 4  # a decoder layer in fp32
    sizes = WeightForms.of_run(rc).compute_side_bytes(rc.placement.weights, "prefill")
    assert max(sizes[1:-1]) == block == sizes[1] and sizes[0] == 0  # the lookups read their rows
    reads = 2 * (padded(common.STORED_CHUNK_BYTES // 2) + ALIGN)  # two chunks of the bf16 table read, in flight
    assert sizes[-1] == 2 * h * 4 + common.STORED_CHUNK_BYTES + reads  # head: its fp32 chunk and two read chunks
    arenas = 2 * block // 2  # two read arenas of a decoder block in bf16 (half its fp32 bytes)
    assert in_flight_bytes(rc, rc.placement, WeightForms.of_run(rc), "prefill") == arenas + 2 * block
    assert largest_batch(rc, plan_of=_whole) == 0 and largest_batch(rc.with_(gpu_mem=600 * MiB), plan_of=_whole) >= 1
    on_use = WeightForms.of_run(rc).with_on_use(PHASES)
    ones = (4 * h + f + h + 4 * h) * 4  # a block's biases and norms, converted whole
    assert in_flight_bytes(rc, rc.placement, on_use, "prefill") == arenas + sizes[-1] + ones + common.STORED_CHUNK_BYTES
    assert plan_memory(rc).forms.on_use == frozenset(PHASES) and largest_batch(rc) >= 1
    assert plan_memory(rc.with_(compute_dtype=torch.bfloat16)).bytes["gpu"]["buffers"] < plan_memory(rc).bytes[
        "gpu"]["buffers"]  # in bf16 nothing is converted: still less
