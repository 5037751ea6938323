"""Every size and flag is checked before anything is built from it; each bad value or combination is one
line on stderr with exit status 2 (never a traceback, never the kernel's OOM killer), and the plan counts the
host buffers that grow with the batch (the logits kept per sequence)."""
from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys

import pytest
import torch

from flexh2o.cli import run as cli
from flexh2o.planning.memory_plan import host_bytes, plan_memory
from tiny_models import tiny_opt, write_tiny_checkpoint

SMALL = ["--model", "opt-125m", "--prompt-len", "8", "--gen-len", "2", "--dtype", "bfloat16", "--no-warmup"]
# the gpu tier's refusal: without a GPU named as the host memory computed in (its flag stays --gpu-mem)
GPU_TIER_NEEDS = "gpu tier needs" if torch.cuda.is_available() else "compute memory (host memory, --gpu-mem) needs"


def _fails(capsys, main, argv, *needles, prog="flexh2o-run"):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"{prog}: error: "), err
    for n in needles:
        assert n in err, err
    return err


def policy_flag_entries(policy: str, task: str) -> list:
    """(main, argv, prog) of the two commands that read a policy's own flag: flexh2o-run --dry-run with `policy` at
    a 16-token budget, and flexh2o-eval `task` with `policy`."""
    from flexh2o.cli import eval as eval_cli
    return [(cli.main, ["--model", "opt-125m", "--prompt-len", "8", "--gen-len", "2", "--dry-run", "--kv-policy",
                        policy, "--kv-budget", "16"], "flexh2o-run"),
            (eval_cli.main, [task, "--policies", policy], "flexh2o-eval")]


@pytest.mark.parametrize("extra,needles", [
    (["--gpu-mem", "inf"], ["'inf'", "finite"]),
    (["--gpu-mem", "1e400"], ["'1e400'", "finite"]),
    (["--cpu-mem", "nan"], ["'nan'"]),
    (["--disk-mem=-1GB"], ["negative"]),
    (["--cpu-mem", ""], ["--cpu-mem is empty"]),
    (["--hh-ratio", "inf"], ["--hh-ratio inf", "[0, 1]"]),
    (["--hh-ratio", "1.5"], ["--hh-ratio 1.5", "[0, 1]"]),
    (["--hh-ratio=-0.1"], ["--hh-ratio -0.1"]),
    (["--hh-ratio", "nan"], ["--hh-ratio nan"]),
    (["--hh-ratio", "0.2", "--recent-ratio", "2"], ["--recent-ratio 2.0"]),
    (["--temperature", "nan"], ["--temperature nan", "finite"]),
    (["--temperature", "inf"], ["--temperature inf"]),
    (["--top-p", "nan"], ["--top-p nan"]),
    (["--num-sinks", "-2"], ["--num-sinks -2"]),
    (["--recent-ratio", "0.1", "--kv-policy", "full"], ["--recent-ratio", "--hh-ratio"]),
    (["--hh-ratio", "0.2", "--recent-ratio", "0.1", "--kv-policy", "full"], ["--kv-policy full keeps every token"]),
    (["--hh-ratio", "0.2", "--kv-budget", "4"], ["--hh-ratio and --kv-budget"]),
    (["--num-gpu-batches", "100000000"], ["--num-gpu-batches 100000000", "--gpu-batch-size"]),
    (["--num-gpu-batches", "0"], ["--num-gpu-batches 0"]),
    (["--gpu-batch-size", "100000000"], [GPU_TIER_NEEDS, "--gpu-mem"]),
    (["--gpu-batch-size", "2000", "--gpu-mem", "4GB", "--cpu-mem", "100MB"], ["cpu tier needs", "--cpu-mem"]),
    (["--gpu-mem", "1000TB"], ["--gpu-mem + --cpu-mem", "exceed this machine's memory"]),
    (["--gpu-batch-size", "1e9"], ["--gpu-batch-size", "positive integer"]),
    (["--seed=-1"], ["--seed -1"]),
    (["--seed", str(1 << 70)], ["--seed"]),
    (["--gen-len", "0"], ["--gen-len 0"]),
])
def test_bad_values_one_line(capsys, tmp_path, extra, needles):
    _fails(capsys, cli.main, SMALL + ["--offload-dir", str(tmp_path / "off")] + extra, *needles)
    assert not (tmp_path / "off").exists() or os.listdir(tmp_path / "off") == []


def test_model_and_path_together(capsys, tmp_path):
    ckpt = write_tiny_checkpoint(str(tmp_path / "ckpt"))
    _fails(capsys, cli.main, ["--model", "opt-125m", "--path", ckpt, "--dry-run"], "--model and --path")
    assert cli.main(["--path", ckpt, "--prompt-len", "4", "--gen-len", "2", "--dry-run"]) == 0


@pytest.mark.parametrize("flag", ["--output-file", "--log-file"])
def test_output_paths_that_are_directories_refused_before_loading(capsys, monkeypatch, tmp_path, flag):
    from flexh2o import job
    monkeypatch.setattr(job, "Engine", None)  # nothing may be built
    _fails(capsys, cli.main, SMALL + [flag, str(tmp_path)], flag, "is a directory")


@pytest.mark.parametrize("dry", [False, True])
def test_huge_batch_refused_by_the_plan_not_the_oom_killer(tmp_path, dry):
    """A real process under a 3 GB address-space limit: without the plan check before the synthetic prompts are
    built it would need ~40 GB and die (or be killed); with it, one line and exit 2 in seconds."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30)); "
            "from flexh2o.cli.run import main; sys.exit(main(sys.argv[1:]))")
    argv = SMALL + ["--gpu-batch-size", "100000000", "--offload-dir", str(tmp_path / "off")]
    argv += ["--dry-run"] if dry else []
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if dry:  # the plan is printed, then the run's refusal (since 2026-12-02, 5d976f9: exit 2)
        assert "does NOT fit" in r.stdout and "predicted" not in r.stdout, r.stderr
    # a tier's refusal (the gpu tier of a CPU run named as the host memory computed in)
    refused = "tier needs" in r.stderr or "compute memory (host memory, --gpu-mem) needs" in r.stderr
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and refused, r.stderr


def test_plan_counts_the_logits_kept_per_sequence(capsys, tmp_path):
    """A reported case: a tiny converted OPT, 64 x 64 sequences, 100 MB gpu and 1 MB cpu planned 90 MiB and peaked
    at 1.1 GiB; the per-sequence logits (num_seqs x vocab x 4 bytes) are now in the cpu tier's plan."""
    cfg = tiny_opt(vocab=50272)
    ckpt = write_tiny_checkpoint(str(tmp_path / "ckpt"), cfg)
    argv = ["--path", ckpt, "--prompt-len", "8", "--gen-len", "2", "--gpu-batch-size", "64", "--num-gpu-batches",
            "64", "--gpu-mem", "100MB", "--cpu-mem", "1MB"]
    _fails(capsys, cli.main, argv, "cpu tier needs", "--cpu-mem")
    rc = cli.build_run_config(cli._parse(argv), cfg, None)
    assert plan_memory(rc).bytes["cpu"]["buffers"] == host_bytes(rc) >= 64 * 64 * cfg.vocab * 4


def test_auto_batch_counts_the_logits(capsys, tmp_path):
    cfg = tiny_opt(vocab=50272)
    ckpt = write_tiny_checkpoint(str(tmp_path / "ckpt"), cfg)
    argv = ["--path", ckpt, "--prompt-len", "8", "--gen-len", "2", "--gpu-batch-size", "auto", "--num-gpu-batches",
            "64", "--gpu-mem", "1GB", "--cpu-mem", "1GB", "--dry-run"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    picked = int(err.split("picked ")[1].split()[0])
    assert 1 <= picked and picked * 64 * cfg.vocab * 4 <= 1 << 30


@pytest.mark.parametrize("field,value", [("num_heads", 0), ("num_layers", -1), ("num_layers", 0),
                                         ("hidden", 64.0), ("vocab", "1000"), ("ffn", None), ("norm_eps", "x"),
                                         ("tie_embeddings", 1), ("pad_token_id", 10 ** 9), ("rope_theta", -1)])
def test_hand_edited_converted_config(capsys, tmp_path, field, value):
    ckpt = write_tiny_checkpoint(str(tmp_path / "ckpt"))
    path = os.path.join(ckpt, "flexh2o_config.json")
    d = json.load(open(path))
    d[field] = value
    json.dump(d, open(path, "w"))
    _fails(capsys, cli.main, ["--path", ckpt, "--prompt-len", "4", "--gen-len", "2", "--dry-run"],
           path, field, "flexh2o-convert")


class _Tok:
    """A stand-in tokenizer: one id per character (ord)."""

    def encode(self, text):
        return [ord(c) for c in text]


def test_text_prompt_ids_beyond_the_vocab(tmp_path):
    from flexh2o.prompts import load_prompts
    p = tmp_path / "p.txt"
    p.write_text("ab\nzz\n")
    assert load_prompts(str(p), 200, _Tok()) == [[97, 98], [122, 122]]
    with pytest.raises(ValueError, match=r"p.txt: line 1 encodes to token id 97, outside .*0..49.*--tokenizer"):
        load_prompts(str(p), 50, _Tok())


def test_non_utf8_prompt_text_names_the_file(tmp_path):
    from flexh2o.prompts import load_prompts
    p = tmp_path / "latin1.txt"
    p.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError) as e:
        load_prompts(str(p), 1000, _Tok())
    assert str(p) in str(e.value) and "UTF-8" in str(e.value) and "0xe9" in str(e.value)


def test_sampler_and_sizes_refuse_non_finite():
    from flexh2o.sampling import Sampler
    from flexh2o.units import parse_bytes
    for t in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError, match="--temperature"):
            Sampler(t)
    for text in ("inf", "1e400", "nan", "-inf", "", "GB"):
        with pytest.raises(ValueError, match="as a size"):
            parse_bytes(text)
    assert parse_bytes("1.5KB") == 1536


def test_eval_budget_percent_over_100(capsys):
    from flexh2o.cli import eval as ev
    from flexh2o.eval.common import budget_tokens
    assert budget_tokens("50%", 200) == 100
    for bad in ("150%", "0%", "-5%", "nan%"):
        with pytest.raises(ValueError, match="budget"):
            budget_tokens(bad, 200)
    _fails(capsys, ev.main, ["ppl", "--budgets", "150%", "--model", "/nonexistent"], "150%", prog="flexh2o-eval")


def test_profile_unknown_device(capsys):
    from flexh2o.cli import profile
    _fails(capsys, profile.main, ["--device", "tpu", "--no-disk", "--quick"], "--device tpu", "cpu or cuda",
           prog="flexh2o-profile")


@pytest.mark.parametrize("extra,needle", [(["--hh-ratio", "1.5"], "--hh-ratio 1.5"),
                                          (["--hh-ratio", "0.2", "--kv-budget", "8"], "--hh-ratio and --kv-budget")])
def test_plan_cli_ratio_checks(capsys, extra, needle):
    from flexh2o.cli import plan
    _fails(capsys, plan.main, ["--model", "opt-125m", "--hardware", "cpu_measured"] + extra, needle,
           prog="flexh2o-plan")


def _run_child(argv: list, env: dict) -> tuple:
    """(exit status, peak RSS bytes) of a fresh flexh2o-run process (ru_maxrss from wait4)."""
    p = subprocess.Popen([sys.executable, "-m", "flexh2o.cli", *argv], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    err = p.stderr.read().decode()
    p.stderr.close()
    assert p.returncode == 0, err
    return p.returncode, usage.ru_maxrss * 1024


SLACK = 96 << 20  # allocator and fragmentation beyond the baseline process


@pytest.mark.slow
def test_measured_peaks_stay_within_the_plan(tmp_path):
    """A grid of batch shapes and placements on a tiny converted OPT with a real-size vocabulary: every tier's
    measured peak is within its plan, and the process's peak RSS within the plan's host bytes (gpu + cpu tiers on a
    CPU-only run) plus the RSS of the same process doing a dry run (imports, torch) plus a fixed slack."""
    cfg = tiny_opt(vocab=50272, hidden=32)
    ckpt = write_tiny_checkpoint(str(tmp_path / "ckpt"), cfg)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    base = ["--path", ckpt, "--prompt-len", "16", "--gen-len", "3", "--no-warmup", "--offload-dir",
            str(tmp_path / "off"), "--disk-mem", "1GB"]
    _, overhead = _run_child(base + ["--dry-run"], env)
    grid = [("1", "1", "100 0 100 0"), ("32", "4", "0 0 0 0 0 0"), ("128", "8", "50 50 20 40 0 100")]
    for i, (gbs, nb, percent) in enumerate(grid):
        log = tmp_path / f"log{i}.jsonl"
        _, rss = _run_child(base + ["--gpu-batch-size", gbs, "--num-gpu-batches", nb, "--percent", *percent.split(),
                                    "--kv-policy", "h2o", "--kv-budget", "8", "--log-file", str(log)], env)
        rec = json.loads(log.read_text())
        plan, peak = rec["plan_bytes"], rec["peak_bytes"]
        total = {t: sum(plan[t].values()) for t in plan}
        assert peak["gpu"] <= total["gpu"], (gbs, nb, percent, peak, plan)
        assert peak["cpu_tier"] <= total["cpu"] and peak["disk"] <= total["disk"], (gbs, nb, percent, peak, plan)
        assert rss <= total["gpu"] + total["cpu"] + overhead + SLACK, (gbs, nb, percent, rss, overhead, plan)
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss > 0


@pytest.mark.parametrize("gbs,nb", [("2", "1"), ("2", "2"), ("3", "1")])
def test_every_prompt_of_a_prompt_file_runs(capsys, tmp_path, gbs, nb):
    """5 prompts with --gpu-batch-size 2 used to generate for 2 and drop 3 (exit 0). Now every prompt runs (in
    rounds), and each gets the tokens it gets in one batch of all five (equal lengths, float32, greedy)."""
    ckpt = write_tiny_checkpoint(str(tmp_path / "ckpt"), tiny_opt(vocab=128))
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([[5 + i, 6 + 2 * i, 7, 8 + i] for i in range(5)]))
    base = ["--path", ckpt, "--gen-len", "3", "--dtype", "float32", "--no-warmup", "--prompt-file", str(prompts)]
    out_all, out = tmp_path / "all.json", tmp_path / "out.json"
    assert cli.main(base + ["--output-file", str(out_all)]) == 0  # default batch: all five at once
    log = tmp_path / "log.jsonl"
    assert cli.main(base + ["--gpu-batch-size", gbs, "--num-gpu-batches", nb, "--output-file", str(out),
                            "--log-file", str(log)]) == 0
    seqs = int(gbs) * int(nb)
    assert f"5 prompts run in {-(-5 // seqs)} rounds" in capsys.readouterr().err
    rows, want = json.loads(out.read_text()), json.loads(out_all.read_text())
    assert len(rows) == 5 and rows == want
    rec = json.loads(log.read_text())
    assert rec["policy"]["rounds"] == -(-5 // seqs) and rec["num_seqs"] == seqs * rec["policy"]["rounds"]


def test_nan_logits_refused_in_one_line():
    """NaN weights reach the sampler as NaN logits: greedy and sampling both refuse them with a ValueError (one line,
    exit 2 through run_main), never a multinomial RuntimeError or a silent argmax over NaN."""
    import torch
    from flexh2o.sampling import Sampler
    logits = torch.zeros(2, 7)
    logits[1, 3] = math.nan
    for s in (Sampler(), Sampler(0.7, 0.9)):
        with pytest.raises(ValueError, match="NaN/Inf logits.*flexh2o-convert"):
            s(logits)
    assert Sampler()(torch.arange(14.0).view(2, 7)).tolist() == [6, 6]


def test_eval_refuses_a_policy_name_before_loading_the_model(capsys):
    from flexh2o.cli import eval as ev
    _fails(capsys, ev.main, ["ppl", "--policies", "h2o,merge:vatp", "--model", "/nonexistent"], "'merge:vatp'",
           prog="flexh2o-eval")
