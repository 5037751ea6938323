"""A cache scheme is one module (a spec and a CacheForm, compress/form.py) plus its field in kv/cache_quant.CacheQuant
(with its flag) and its line in form_spec: a toy scheme written in this file only, which holds each K and V as twice
its values, is counted by the layout (parts, bytes), held by a block, written by prefill and decode, read and evicted
through the protocol, stored and loaded by the cache, and gives the plain cache's outputs and kept tokens; with its
field, its flag is one of flexh2o-run's, -serve's, -plan's and -eval's, the API's keyword and the printed command
line's, and reaches the engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from flexh2o.compress.form import CacheForm
from flexh2o.kv import attention, cache_quant
from flexh2o.kv.cache import KVBlock, KVCache
from flexh2o.kv.layout import CacheLayout, CacheQuant
from flexh2o.kv.policies import Budget
from flexh2o.kv.spec import make_policy
from flexh2o.storage.memory import MemoryTier

B, H, S, D, T = 2, 2, 8, 16, 7  # rows, KV heads, slots, head_dim, prompt tokens (more than the budget)


class Twice(CacheForm):
    """The toy form: one tensor holding 2 x each value (exact in fp32 both ways), read expanded."""

    def __init__(self, twice: torch.Tensor):
        self.twice = twice

    shape = property(lambda self: tuple(self.twice.shape))
    dtype = property(lambda self: self.twice.dtype)

    def tensors(self) -> dict:
        return {"twice": self.twice}

    def map(self, fn) -> "Twice":
        return Twice(fn(self.twice))

    def front(self, n: int) -> "Twice":
        return Twice(self.twice[:, :, :n])

    def assign(self, index, values) -> None:
        self.twice[index] = (values * 2).to(self.twice.dtype)

    def expanded(self, dtype) -> torch.Tensor:
        return (self.twice / 2).to(dtype)


class TwiceSpec:
    def form_parts(self, shape, dtype) -> dict:
        return {"twice": (tuple(shape), dtype, True)}

    def build(self, tensors, shape) -> Twice:
        return Twice(tensors["twice"])


@pytest.fixture
def twice(monkeypatch):
    monkeypatch.setattr(CacheQuant, "form_spec", lambda self, field, slots, head_dim: TwiceSpec())  # its one line
    return CacheLayout(B, H, S, D, torch.float32, CacheQuant())


def test_the_layout_counts_a_new_scheme_from_its_spec(twice):
    plain = CacheLayout(B, H, S, D, torch.float32)
    assert [p.key for p in twice.parts()] == ["k.twice", "v.twice", "pos", "score"]
    assert twice.nbytes == plain.nbytes and twice.kv_slot_bytes() == plain.kv_slot_bytes()


@pytest.mark.parametrize("policy", ["h2o", "mean_vnorm", "mean_keydiff"])
def test_a_new_scheme_runs_prefill_and_decode_as_the_plain_cache(twice, policy):
    """Twice holds the values exactly (x 2 and / 2 are exact in fp32) and is read expanded by the same einsums as a
    plain block whose policy scores (a policy that scores nothing runs the fused kernel on a plain block), so
    outputs, kept positions and scores are equal bit for bit; the policies read the values and the keys through it."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, T, D, generator=g) for n in (2 * H, H, H))
    pos = torch.arange(T).expand(B, T).clone()
    budget = Budget(4, 2)  # heavy tokens hold the 4 sinks of the policies that keep them
    blocks, outs = [], []
    for layout in (CacheLayout(B, H, S, D, torch.float32), twice):
        blk, pol = KVBlock.of_layout(layout, "cpu"), make_policy(policy, budget)
        out = [attention.prefill(q, k, v, pos, pol, 0, blk, 64)]
        for step in range(T, T + 3):
            qd, kd, vd = (torch.randn(B, n, 1, D, generator=torch.Generator().manual_seed(step)) for n in (2 * H, H, H))
            out.append(attention.decode(qd, kd, vd, torch.full((B,), step), blk, pol, 0))
        blocks.append(blk)
        outs.append(out)
    assert isinstance(blocks[1].v, Twice)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert torch.equal(blocks[0].pos, blocks[1].pos) and torch.equal(blocks[0].score, blocks[1].score)
    assert torch.equal(blocks[0].v, blocks[1].v.expanded(torch.float32))


def test_the_cache_stores_and_loads_a_new_scheme(twice):
    tier = MemoryTier("cpu", "cpu", 1 << 20)
    cache = KVCache({"cpu": tier}, [["cpu"]], B, H, S, D, torch.float32, CacheQuant())
    try:
        blk = cache.load(0, 0, "cpu")
        x = torch.randn(B, H, S, D)
        blk.v.assign((slice(None),) * 3, x)
        cache.store(0, 0, blk)
        assert torch.equal(cache.load(0, 0, "cpu").v.expanded(torch.float32), x)
    finally:
        cache.close()


@dataclass(frozen=True)
class TwiceQuant(CacheQuant):
    """CacheQuant with the toy scheme's field and its line in form_spec, as an edit of kv/cache_quant.py adds them."""

    twice: bool = field(default=False, metadata={"flag": cache_quant.CacheFlag(
        "--cache-twice", "--compress-cache: hold K and V as twice their values (a toy scheme)", action="store_true")})

    def form_spec(self, field: str, slots: int, head_dim: int):
        return TwiceSpec() if self.twice else super().form_spec(field, slots, head_dim)


@pytest.fixture
def twice_field(monkeypatch):
    monkeypatch.setattr(cache_quant, "CacheQuant", TwiceQuant)  # kv/cache_quant.py's class, with the field added
    return TwiceQuant


def test_a_new_schemes_field_is_its_flag_in_every_script(twice_field):
    """--cache-twice is in flexh2o-run's, -serve's, -plan's and -eval's --help, parses into the CacheQuant, is the
    API's keyword, is printed back by the search's command line and is refused without --compress-cache."""
    from flexh2o.cli import eval as eval_cli, plan as plan_cli, run as run_cli, serve as serve_cli
    from flexh2o.cli.compress_flags import compression_specs
    from flexh2o.cli.engine_args import EngineArgs
    from flexh2o.tuning.search import compression_flags
    ppl = eval_cli.build_parser()._subparsers._group_actions[0].choices["ppl"]
    for parser in (run_cli.build_parser(), serve_cli.build_parser(), plan_cli.build_parser(), ppl):
        assert "hold K and V as twice their values" in " ".join(parser.format_help().split())
        assert parser.get_default("cache_twice") is False
    args = run_cli.build_parser().parse_args(["--compress-cache", "--cache-twice", "--cache-recent", "2"])
    quant = compression_specs(args)[1]
    assert type(quant) is TwiceQuant and quant.twice and quant.recent == 2
    assert compression_specs(EngineArgs.from_options({"compress_cache": True, "cache_twice": True,
                                                      "cache_recent": 2}))[1] == quant
    assert compression_specs(run_cli.build_parser().parse_args(["--compress-cache"]))[1].twice is False
    line = compression_flags(SimpleNamespace(compress_weight=None, compress_cache=quant, weight_kernel="auto"))
    assert "--cache-twice" in line
    assert compression_specs(run_cli.build_parser().parse_args(" ".join(line).split()))[1] == quant
    with pytest.raises(ValueError, match="--cache-twice sets the quantized KV cache, which is off"):
        compression_specs(run_cli.build_parser().parse_args(["--cache-twice"]))


@pytest.mark.filterwarnings("ignore:kv_budget 6 is under")
def test_a_new_schemes_flag_reaches_the_engine(twice_field, monkeypatch, tmp_path, offload_dir):
    """The API's cache_twice=True (its flag's keyword) makes the engine's blocks Twice forms, whose run gives the
    plain cache's tokens (Twice is exact in fp32 and read by the same einsums as a plain block whose policy scores)."""
    from flexh2o import LLM, SamplingParams
    from tiny_models import write_tiny_checkpoint
    built = []
    monkeypatch.setattr(TwiceSpec, "build", lambda self, tensors, shape: built.append(shape) or Twice(tensors["twice"]))
    ckpt = write_tiny_checkpoint(str(tmp_path / "ckpt"))
    common = dict(kv_policy="h2o", kv_budget=6, gpu_batch_size=2, dtype="float32", compute_dtype="float32",
                  offload_dir=offload_dir, no_warmup=True, verbose=0)
    prompts, params = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28]], SamplingParams(
        max_tokens=6, ignore_eos=True)
    with LLM(ckpt, **common) as plain:
        want = [r.token_ids for r in plain.generate(prompts, params)]
    assert not built
    with LLM(ckpt, compress_cache=True, cache_twice=True, **common) as toy:
        got = [r.token_ids for r in toy.generate(prompts, params)]
    assert built and got == want
    with pytest.raises(ValueError, match="cache_twice sets the quantized KV cache, which is off: add compress_cache"):
        LLM(ckpt, cache_twice=True, **common).generate(prompts, params)  # refused in the API's names
