"""The policy search inside a gpu-tier cap (since 2026-12-03, ea36e03) finds a placement whenever the engine can run
one, and when none fits it states the least the gpu tier needs, made of two layers of weights in flight and the
working buffers.

On a CPU-only run the cpu tier is host memory like the gpu tier, and a weight homed there in the compute dtype is
used where it lives (the engine's load copies and charges nothing), so the plan reserves nothing for it."""
from __future__ import annotations

import re

import pytest
import torch

from flexh2o.cli import run as cli
from flexh2o.config import ModelConfig, from_name
from flexh2o.engine import Engine
from flexh2o.models import layer_specs
from flexh2o.placement import Percent, Placement
from flexh2o.planning.memory_plan import plan_memory
from flexh2o.run_config import RunConfig
from flexh2o.tuning.hardware import load_profile
from flexh2o.tuning.least import least_plan
from flexh2o.tuning.search import search
from flexh2o.weights.forms import WeightForms
from flexh2o.weights.stored_form import stored_weight_bytes

MiB = 1 << 20
TINY = ModelConfig("tiny", "opt", hidden=64, num_layers=2, num_heads=4, ffn=256, vocab=512, max_positions=64)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("percent", ["0 100 100 0", "0 0 100 0", "50 50 0 100", "30 30 30 30"])
@pytest.mark.parametrize("dtype,compute", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                           (torch.bfloat16, torch.bfloat16)])
def test_plan_counts_what_the_weight_loads_copy(offload_dir, percent, dtype, compute):
    """Per layer, the bytes the engine's weight load copies to the compute side are the plan's figure: nothing for
    a weight on gpu or cpu already in the compute dtype, its bytes at the compute dtype otherwise (disk, conversion)."""
    rc = RunConfig(model=TINY, percent=Percent.parse(percent.split()), gpu_batch_size=2, prompt_len=8, gen_len=2,
                   dtype=dtype, compute_dtype=compute, offload_dir=offload_dir)
    with Engine(rc) as eng:
        for layer, specs in enumerate(rc.placement.weights.layer_specs):
            tensors, copied = eng.weights.load_layer(layer, torch.device("cpu"), compute)
            homes = [rc.placement.weights[s.name] for s in specs]
            want = sum(s.numel * compute.itemsize for s, home in zip(specs, homes)  # independent of forms.py
                       if home == "disk" or dtype != compute)
            assert copied == want, (layer, homes)
            assert WeightForms.of_run(rc).compute_side_bytes(rc.placement.weights, "decode")[layer] == want
            eng.weights.release(tensors)


def _rc(gpu_mem: int, cpu_mem: int, model="opt-1.3b", **kw) -> RunConfig:
    return RunConfig(**{**dict(model=from_name(model), percent=Percent.parse([100, 0, 100, 0, 100, 0]),
                               gpu_batch_size=1, prompt_len=64, gen_len=8, dtype=torch.bfloat16,
                               compute_dtype=torch.bfloat16, gpu_mem=gpu_mem, cpu_mem=cpu_mem,
                               disk_mem=100 << 30), **kw})


@pytest.mark.parametrize("cap", [157, 315])
def test_the_search_finds_what_fits_inside_the_cap(cap):
    """opt-1.3b at bf16 under 157 or 315 MiB of gpu tier with room on cpu: the search finds a placement (main before
    this said none fits: it reserved 2 x 204 MiB for weights that are never copied) and its plan fits."""
    found = search(_rc(cap * MiB, 8 << 30), load_profile("cpu_measured"), limit=1)
    assert found
    plan = plan_memory(found[0][0])
    assert plan.overflow() is None and plan.total("gpu") <= cap * MiB


def test_the_found_placement_runs_inside_the_cap(offload_dir):
    """opt-125m at bf16 under a 48 MiB gpu tier (two of its 80 MB embedding layers would not fit): the searched
    placement runs, its gpu tier peaks under the cap, and its tokens are those of the same batch memory-resident."""
    rc = _rc(48 * MiB, 2 << 30, "opt-125m", prompt_len=16, gen_len=3, offload_dir=offload_dir)
    found = search(rc, load_profile("cpu_measured"), limit=1, max_seqs=4)
    assert found
    best = found[0][0]
    prompts = [[5 + i, 17, 200 + i, 9] for i in range(best.num_seqs)]
    with Engine(best) as eng:
        got = eng.generate(prompts, 3).tokens
        assert eng.tiers["gpu"].peak <= 48 * MiB
    resident = best.with_(percent=Percent.parse([100, 0, 100, 0, 100, 0]), gpu_mem=2 << 30)
    resident = resident.placed(Placement.build(layer_specs(resident.model), resident.percent,
                                               resident.num_gpu_batches))
    with Engine(resident) as eng:
        assert torch.equal(torch.as_tensor(got), torch.as_tensor(eng.generate(prompts, 3).tokens))


def _layer_numel(cfg) -> list:
    """Elements of each OPT layer's weights from the model's sizes (embedding layer, decoder layers, head)."""
    h, f = cfg.hidden, cfg.ffn
    decoder = 4 * (h * h + h) + 2 * h * f + f + h + 4 * h
    return [(cfg.vocab + cfg.max_positions + 2) * h] + [decoder] * cfg.num_layers + [2 * h + cfg.vocab * h]


@pytest.mark.parametrize("cap", ["157MiB", "200MiB"])
def test_none_fits_names_the_exact_least(cap, capsys, offload_dir):
    """With 64 MiB of cpu tier the weights must stream from disk: no placement fits 157 or 200 MiB, and the one
    error line names the least gpu tier bytes, the search boundary, of which two layers of weights in flight (the
    largest, a decoder layer, from the model's sizes: the tables on disk are read by rows and chunks, so the head
    layer holds its chunk buffers while it multiplies, weights/stored_form.py: counted once, for the layer
    computing) and the rest the working buffers of the same placement."""
    args = ["--model", "opt-1.3b", "--prompt-len", "64", "--gen-len", "8", "--dtype", "bfloat16", "--compute-dtype",
            "bfloat16", "--gpu-mem", cap, "--cpu-mem", "64MiB", "--disk-mem", "100GB", "--policy", "auto",
            "--hardware", "cpu_measured", "--offload-dir", offload_dir, "--no-warmup"]
    assert cli.main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1, err
    m = re.search(r"weights on disk.*needs [\d.]+ \w+ in (?:the gpu tier|compute memory \(host memory, --gpu-mem\)) "
                  r".*2 x 96.1 MiB \(layer 1; its largest "
                  r"weight model.decoder.layers.0.fc1.weight \(8192, 2048\): 32.0 MiB\).* at least .* \((\d+) "
                  r"bytes\)", err[0])
    assert m, err[0]
    need, cfg = int(m.group(1)), from_name("opt-1.3b")
    layers = _layer_numel(cfg)
    assert [sum(s.numel for s in layer) for layer in layer_specs(cfg)] == layers
    least = least_plan(_rc(157 * MiB, 64 * MiB))
    p = least.rc.percent
    in_place = least.rc.with_(percent=Percent(0, 100, p.cache_gpu, p.cache_cpu, p.act_gpu, p.act_cpu))
    rest = plan_memory(in_place.placed(Placement.build(layer_specs(cfg), in_place.percent, 1))).total("gpu")
    head = [s for s in layer_specs(cfg)[-1] if len(s.shape) == 2][0]  # the tied table, read in chunks at the head
    chunks = stored_weight_bytes(cfg.num_layers + 1, head, torch.bfloat16, torch.bfloat16, False, by_rows=True)
    assert need == 2 * max(layers[1:-1]) * 2 + chunks + rest  # two arenas of a block, the head's buffers once
    hw = load_profile("cpu_measured")
    assert search(_rc(need, 64 * MiB), hw, limit=1) and not search(_rc(need - 1, 64 * MiB), hw, limit=1)
