"""flexh2o-run under torchrun (2 local ranks on 127.0.0.1): one summary and one JSON record from the head's rank,
tokens equal transformers, a pre-flight refusal on one rank stops both with one line, a killed rank or Ctrl-C on
the launcher ends the job within a bounded time with no offload files left."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import hf_greedy, ragged_prompts
from dist_util import free_port, rank_env
from readiness import ready_env, wait_decoding
from flexh2o.cli import run as cli

MAX_S = 60  # a launch that takes longer than this is a hang


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A converted 4-layer OPT (transformers save_pretrained -> flexh2o-convert), its HF model and prompts."""
    from transformers import OPTConfig, OPTForCausalLM

    from flexh2o.cli import convert
    d = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=500, hidden_size=32, num_hidden_layers=4, ffn_dim=64,
                                     num_attention_heads=4, max_position_embeddings=1024, word_embed_proj_dim=32))
    model.eval().save_pretrained(d / "hf")
    assert convert.main([str(d / "hf"), str(d / "conv"), "--dtype", "float32"]) == 0
    prompts = ragged_prompts(4, 7, 500, seed=11)
    (d / "p.json").write_text(json.dumps(prompts))
    return d, model, prompts


def _torchrun(args: list, offload_dir: str, ready=None, **kw) -> subprocess.Popen:
    """flexh2o-run under torchrun with 2 ranks; `ready`: the ready file its ranks announce their decode in."""
    env = dict(os.environ, **{k: v for k, v in rank_env(0, 2, 0).items() if k.startswith(("OMP", "GLOO"))})
    env = ready_env(ready, env) if ready is not None else env
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "flexh2o.cli", "--dtype", "float32", "--compute-dtype", "float32",
           "--offload-dir", offload_dir, "--no-warmup", "--stage-timeout", "20"] + args
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _finish(proc: subprocess.Popen) -> tuple:
    out, err = proc.communicate(timeout=MAX_S)
    return proc.returncode, out, err


# slow (this and the torchrun tests below): each launches torchrun and two ranks; the stages' outputs in
# one process: tests/pipeline/test_dist_stages.py
@pytest.mark.slow
def test_one_summary_and_record_from_the_head_and_tokens_equal_transformers(tiny, tmp_path, offload_dir):
    d, model, prompts = tiny
    out, log = tmp_path / "out.json", tmp_path / "log.json"
    rc, stdout, stderr = _finish(_torchrun(["--path", str(d / "conv"), "--prompt-file", str(d / "p.json"),
                                            "--gen-len", "5", "--percent", "0", "0", "50", "0", "--gpu-batch-size",
                                            "2", "--num-gpu-batches", "2", "--output-file", str(out),
                                            "--log-file", str(log)], offload_dir))
    assert rc == 0, stderr
    assert stdout.count("tok/s (generated)") == 1 and stdout.count("\nstage ") == 2, stdout
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 1 and [s["stage"] for s in records[0]["stages"]] == [0, 1]
    for s in records[0]["stages"]:
        assert min(s["compute_s"], s["io_s"], s["wait_s"]) >= 0 and s["sent_bytes"] > 0
    assert records[0]["stages"][0]["sent_bytes_per_decode_step"] == 2 * 2 * 32 * 4  # batches x rows x hidden x fp32
    got = [r["tokens"] for r in json.loads(out.read_text())]
    assert got == [hf_greedy(model, p, 5)[0] for p in prompts]


@pytest.mark.slow
def test_a_refusal_on_one_rank_stops_both_with_one_line(tiny, offload_dir):
    """--stage-layers 1,3 with a gpu tier that holds one stage but not the other: that rank refuses, every rank
    exits 2 (every rank raises the agreed refusal: test_dist_stages), and the machine shows the refusal once."""
    d, _, _ = tiny
    gpu_mem, refuser = _between_stage_needs(d)
    args = ["--path", str(d / "conv"), "--prompt-file", str(d / "p.json"), "--gen-len", "4", "--stage-layers", "1,3",
            "--percent", "100", "0", "100", "0", "--gpu-mem", gpu_mem, "--gpu-batch-size", "4"]
    rc, _, stderr = _finish(_torchrun(args, offload_dir))
    lines = [line for line in stderr.splitlines() if line.startswith("flexh2o-run: error:")]
    # the gpu tier in a CPU-only run's words (the host memory computed in) or a CUDA run's
    assert len(lines) == 1 and re.search(rf"rank {refuser}: (gpu tier|compute memory \(host memory, --gpu-mem\)) "
                                         "needs", lines[0]), stderr
    # torchrun's summary: a worker exited 2 (torchrun may stop the other before it exits 2 as well)
    assert rc != 0 and "exitcode  : 2" in stderr and "/flexh2o/" not in stderr, stderr  # no traceback of ours


def _between_stage_needs(d) -> tuple:
    """(a --gpu-mem between the two stages' gpu-tier needs, the rank of the larger)."""
    from flexh2o import config
    from flexh2o.pipeline.job import stage_memory_plan
    from flexh2o.pipeline.pipe import stage_config
    from flexh2o.pipeline.split import split_stages
    from flexh2o.run_config import RunConfig
    cfg = config.load_converted_config(str(d / "conv"))
    rc = RunConfig(model=cfg, gpu_batch_size=4, prompt_len=7, gen_len=4, dtype=torch.float32,
                   compute_dtype=torch.float32)
    need = [stage_memory_plan(stage_config(rc, s, torch.device("cpu")), s).total("gpu")
            for s in split_stages(cfg, 2, [1, 3])]
    assert need[0] != need[1]
    return str((need[0] + need[1]) // 2), int(need[1] > need[0])


def _long_run(d, offload_dir) -> subprocess.Popen:
    """A job long enough to be stopped midway, with weights and cache on disk (files to clean up); its ranks
    announce their decode in _ready(offload_dir)."""
    return _torchrun(["--path", str(d / "conv"), "--prompt-len", "8", "--gen-len", "1000", "--percent", "0", "0", "0",
                      "0", "--gpu-batch-size", "2", "--num-gpu-batches", "2"], offload_dir, ready=_ready(offload_dir),
                     start_new_session=True)


def _ready(offload_dir) -> str:
    return str(offload_dir).rstrip("/") + ".ready"  # beside --offload-dir, which must be left empty


def _run_dirs(offload_dir) -> list:
    return [n for n in os.listdir(offload_dir) if n.startswith("flexh2o-run-")] if os.path.isdir(offload_dir) else []


def _wait_for_both_stages(proc, offload_dir) -> list:
    """The two stages' run dirs, once both ranks have said they are decoding (their lines in the ready file)."""
    wait_decoding(_ready(offload_dir), proc, processes=2, timeout=MAX_S)
    assert proc.poll() is None, "the job ended before it could be stopped"
    return _run_dirs(offload_dir)


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_with_a_clear_error_and_no_files(tiny, offload_dir):
    d, _, _ = tiny
    proc = _long_run(d, offload_dir)
    dirs = _wait_for_both_stages(proc, offload_dir)
    victim = int(dirs[0][len("flexh2o-run-"):].split("-")[0])  # a run dir is named after its owner's pid
    os.kill(victim, signal.SIGKILL)
    start = time.monotonic()
    rc, _, stderr = _finish(proc)
    assert time.monotonic() - start < 30
    assert rc != 0 and "Signal 9 (SIGKILL)" in stderr, stderr  # torchrun names the killed rank
    assert "flexh2o-run: error: rank" in stderr or "flexh2o-run: interrupted" in stderr, stderr
    assert not _run_dirs(offload_dir), f"offload files left behind: {_run_dirs(offload_dir)}, killed {victim}\n{stderr}"


@pytest.mark.slow
def test_ctrl_c_on_the_launcher_cleans_up_every_rank(tiny, offload_dir):
    d, _, _ = tiny
    proc = _long_run(d, offload_dir)
    _wait_for_both_stages(proc, offload_dir)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal does: the launcher and its workers get SIGINT
    start = time.monotonic()
    rc, _, stderr = _finish(proc)
    assert time.monotonic() - start < 30 and rc != 0
    assert stderr.count("flexh2o-run: interrupted; offload files removed") == 2, stderr
    assert not _run_dirs(offload_dir), "offload files left behind"


def test_stage_layers_without_torchrun_is_refused(tiny, capsys):
    d, _, _ = tiny
    assert cli.main(["--path", str(d / "conv"), "--stage-layers", "2,2", "--gen-len", "2", "--prompt-len", "4",
                     "--dry-run"]) == 0  # a dry run plans one process and ignores stages
    assert cli.main(["--path", str(d / "conv"), "--stage-layers", "2,2", "--gen-len", "2", "--prompt-len", "4",
                     "--no-warmup"]) == 2
    assert "names 2 stages but 1 ranks run" in capsys.readouterr().err


def _stage_weight_bytes(d, counts: list) -> list:
    """fp32 weight bytes of each stage, summed from the model's per-layer tensor list (not from a plan)."""
    from flexh2o import config
    from flexh2o.models import layer_specs
    specs = layer_specs(config.load_converted_config(str(d / "conv")))
    cuts = [0, 1 + counts[0], len(specs)]  # stage 0: embedding + its decoder layers; stage 1: the rest + head
    return [4 * sum(s.numel for layer in specs[cuts[i]:cuts[i + 1]] for s in layer) for i in range(2)]


@pytest.mark.slow
def test_a_dry_run_under_torchrun_prints_each_ranks_own_stage_plan(tiny, offload_dir):
    from flexh2o.units import fmt_bytes
    d, _, _ = tiny
    rc, stdout, stderr = _finish(_torchrun(["--path", str(d / "conv"), "--dry-run", "--stage-layers", "1,3",
                                            "--percent", "0", "100", "100", "0", "--prompt-len", "7", "--gen-len",
                                            "4", "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--gpu-mem",
                                            "1GB", "--cpu-mem", "1GB"], offload_dir))
    assert rc == 0, stderr
    blocks = {b.split(",")[0]: b for b in ("\n" + stdout).split("\nrank ")[1:]}
    assert sorted(blocks) == ["0 of 2", "1 of 2"], stdout
    assert "stage 0: embedding, decoder layers 0..0 " in blocks["0 of 2"]
    assert "stage 1: decoder layers 1..3, head " in blocks["1 of 2"]
    for (name, block), weights in zip(sorted(blocks.items()), _stage_weight_bytes(d, [1, 3])):
        cpu = [line.split() for line in block.splitlines() if line.startswith("cpu ")][0]
        assert " ".join(cpu[1:3]) == fmt_bytes(weights), (name, block)  # this stage's weights, all on the cpu tier
        assert "\nfits\nlargest --gpu-batch-size that fits: full " in block, block
    assert not _run_dirs(offload_dir)  # a dry run allocates nothing


def test_a_bad_split_in_a_dry_run_under_torchrun_is_one_line_and_exit_2(tiny, capsys, monkeypatch):
    d, _, _ = tiny
    for rank in ("0", "1"):  # no process group is joined: every rank refuses the split alike
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert cli.main(["--path", str(d / "conv"), "--stage-layers", "2,3", "--dry-run"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--stage-layers 2,3" in err[0] and "sum to the 4 decoder layers" in err[0], err


def test_a_run_dir_being_born_is_never_taken_for_a_killed_runs(tmp_path, monkeypatch):
    """Two ranks on one machine start at once with one --offload-dir: when the owner takes its lock, a sweeper
    looking at that moment must not see a free lock file (it would remove the directory being born)."""
    from flexh2o.storage import dirlock, offload_dir
    real_flock, seen = dirlock.fcntl.flock, []

    def flock(fd, op):
        if not seen:  # the owner's own lock: what would a sweeper see right now?
            seen.append([n for n in os.listdir(tmp_path)])
            seen.append(offload_dir.remove_stale_run_dirs(str(tmp_path)))
        return real_flock(fd, op)
    monkeypatch.setattr(dirlock.fcntl, "flock", flock)
    run = offload_dir.make_run_dir(str(tmp_path))
    monkeypatch.undo()
    assert seen[1] == [] and os.path.isdir(run.path), seen
    assert offload_dir.lock_state(run.path) is True
    run.remove()
