"""FlexGen's whole flex_opt command line and the H2O port's flags: each accepted with FlexGen's meaning, or refused
in one line (exit 2) saying why and what to use instead."""
from __future__ import annotations

import json

import pytest
import torch

from flexh2o import config as model_configs
from flexh2o.cli import run as cli
from flexh2o.cli.flexgen_flags import FEWER_BATCH_STEPS, flexgen_options
from flexh2o.compress.defaults import DEFAULT_CACHE_GROUP

BASE = ["--model", "opt-125m", "--prompt-len", "8", "--gen-len", "6", "--gpu-batch-size", "2", "--dtype", "float32",
        "--compute-dtype", "float32", "--no-warmup"]


def _rc(argv: list):
    """(RunConfig, FlexGenOptions) the flags make, without running."""
    args = cli.build_parser().parse_args(BASE + argv)
    opts = flexgen_options(args)
    return cli.build_run_config(args, model_configs.from_name(args.model), None), opts


def _refused(capsys, argv: list, *needles) -> str:
    assert cli.main(BASE + argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("flexh2o-run: error: "), err
    for n in needles:
        assert n in err, err
    return err


# ---- accepted with FlexGen's meaning ----------------------------------------------------------------------------
def test_model_with_facebook_prefix_and_dummy_path():
    rc, _ = _rc(["--model", "facebook/opt-125m", "--path", "_DUMMY_"])
    assert rc.model.name == "opt-125m" and rc.path == "_DUMMY_"


def test_lengths_batches_and_percent():
    rc, _ = _rc(["--prompt-len", "16", "--gen-len", "4", "--gpu-batch-size", "3", "--num-gpu-batches", "2",
                 "--percent", "20", "30", "40", "50", "60", "10"])
    assert (rc.prompt_len, rc.gen_len, rc.gpu_batch_size, rc.num_gpu_batches) == (16, 4, 3, 2)
    assert str(rc.percent) == "20 30 40 50 60 10"


def test_offload_dir(tmp_path):
    rc, _ = _rc(["--offload-dir", str(tmp_path)])
    assert rc.offload_dir == str(tmp_path)


def test_cpu_cache_compute():
    assert _rc(["--cpu-cache-compute"])[0].cpu_cache_compute and not _rc([])[0].cpu_cache_compute


@pytest.mark.parametrize("argv, want", [([], True), (["--overlap"], True), (["--overlap", "false"], False),
                                        (["--overlap", "True"], True), (["--overlap", "0"], False)])
def test_overlap_is_a_flexgen_boolean(argv, want):
    assert _rc(argv)[0].overlap is want


def test_overlap_needs_a_boolean(capsys):
    _refused(capsys, ["--overlap", "maybe"], "--overlap", "boolean")


@pytest.mark.parametrize("argv, want", [([], True), (["--pin-weight"], True), (["--pin-weight", "false"], False)])
def test_pin_weight(argv, want):
    rc, opts = _rc(argv)
    assert rc.pin_weight is want and opts.pin_weight is want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning only exists with CUDA")
def test_pin_weight_false_leaves_the_cpu_tier_unpinned():
    from flexh2o.storage.factory import make_tiers
    rc, _ = _rc(["--pin-weight", "false", "--device", "cuda"])
    assert not make_tiers(rc, need_disk=False)["cpu"].pin


def test_sep_layer_false_is_flexh2o_schedule():
    _rc(["--sep-layer", "false"])  # accepted: one schedule unit per decoder layer


@pytest.mark.parametrize("argv", [["--sep-layer"], ["--sep-layer", "true"]])
def test_sep_layer_true_refused(capsys, argv):
    _refused(capsys, argv, "--sep-layer", "drop the flag")


def test_attn_sparsity_one_is_dense():
    _rc(["--attn-sparsity", "1.0"])


def test_attn_sparsity_below_one_refused(capsys):
    _refused(capsys, ["--attn-sparsity", "0.5"], "--attn-sparsity", "--hh-ratio")


def test_compress_weight_and_cache_are_flexgen_4_bit_groups_of_64():
    """FlexGen's groups (4 bits, 64 values, weights along dimension 0) with --weight-kernel off, and its per-token
    cache (--cache-keys token); on the CPU by default the weights are grouped along the input dimension for the int4
    kernel, chosen per phase, and the cache's keys per channel take the cache's own groups (compress/defaults.py)."""
    rc, _ = _rc(["--compress-weight", "--compress-cache", "--weight-kernel", "off", "--cache-keys", "token"])
    assert (rc.compress_weight.bits, rc.compress_weight.group_size, rc.compress_weight.group_dim) == (4, 64, 0)
    assert (rc.compress_cache.bits, rc.compress_cache.group_size, rc.compress_cache.group_dim) == (4, 64, -1)
    assert rc.weight_kernel == "generic"
    rc, _ = _rc(["--compress-weight", "--compress-cache"])
    assert (rc.compress_weight.group_dim, rc.weight_kernel) == (1, "auto")
    assert (rc.compress_weight.group_size, rc.compress_cache.group_size) == (64, DEFAULT_CACHE_GROUP)
    assert _rc([])[0].compress_weight is None and _rc([])[0].compress_cache is None


def test_weight_kernel_flags():
    assert _rc(["--compress-weight", "--weight-kernel", "int4"])[0].weight_kernel == "int4"
    rc, _ = _rc(["--compress-weight", "--compress-bits", "8"])  # no 8-bit kernel layout: FlexGen's grouping
    assert (rc.compress_weight.group_dim, rc.compress_weight.bits) == (0, 8)


@pytest.mark.parametrize("argv", [["--compress-bits", "8"], ["--compress-group-size", "16"]])
def test_weight_kernel_int4_outside_its_layouts_refused(capsys, argv):
    _refused(capsys, ["--compress-weight", "--weight-kernel", "int4"] + argv, "--weight-kernel int4")


def test_compress_bits_and_group_size():
    rc, _ = _rc(["--compress-cache", "--compress-bits", "8", "--compress-group-size", "32"])
    assert (rc.compress_cache.bits, rc.compress_cache.group_size) == (8, 32)


def test_bad_compress_group_size_refused(capsys):
    _refused(capsys, ["--compress-weight", "--compress-group-size", "7"], "--compress-group-size")


@pytest.mark.parametrize("argv", [["--hh-all"], ["--hh-all", "true"], []])
def test_hh_ratio_and_hh_all(argv):
    rc, _ = _rc(["--hh-ratio", "0.25", "--exact-ratio"] + argv)  # the ratio itself, under the floor of a short prompt
    assert rc.kv.policy == "h2o" and (rc.kv.budget.heavy, rc.kv.budget.recent) == (2, 2)


def test_hh_all_false_refused(capsys):
    _refused(capsys, ["--hh-ratio", "0.25", "--hh-all", "false"], "--hh-all false", "drop the flag")


def test_hh_long_seq_refused(capsys):
    _rc(["--hh-long-seq", "false"])
    _refused(capsys, ["--hh-long-seq"], "--hh-long-seq")


def test_debug_mode_breakdown_refused(capsys):
    _refused(capsys, ["--debug-mode", "breakdown"], "breakdown", "--dry-run")


def test_cut_gen_len_too_short_refused(capsys):
    _refused(capsys, ["--cut-gen-len", "1"], "--cut-gen-len", "at least 2")


def test_debug_mode_fewer_batch_defaults_to_a_shortened_run():
    assert _rc(["--gen-len", "32", "--debug-mode", "fewer_batch"])[1].measured_steps == FEWER_BATCH_STEPS
    assert _rc(["--gen-len", "32", "--debug-mode", "fewer_batch", "--cut-gen-len", "3"])[1].measured_steps == 3
    assert _rc(["--gen-len", "4", "--cut-gen-len", "9"])[1].measured_steps is None  # nothing to cut


def test_cut_gen_len_runs_a_shortened_run_and_marks_it_projected(capsys, tmp_path):
    log, out = tmp_path / "log.jsonl", tmp_path / "out.json"
    assert cli.main(BASE + ["--gen-len", "12", "--cut-gen-len", "3", "--debug-mode", "fewer_batch", "--log-file",
                            str(log), "--output-file", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "PROJECTED from 3 of 12 steps" in summary
    rec = json.loads(log.read_text())
    assert rec["projected"] is True and rec["measured_steps"] == 3 and rec["gen_len"] == 12
    assert rec["decode_s"] == pytest.approx(rec["measured_decode_s"] / 2 * 11)
    assert all(len(r["tokens"]) == 3 for r in json.loads(out.read_text()))


def test_log_file_auto_no_log_and_verbose(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(BASE + ["--log-file", "auto", "--verbose", "0", "--compress-cache"]) == 0
    assert capsys.readouterr().out == ""  # --verbose 0: no summary
    logs = list(tmp_path.glob("*.log"))
    assert [p.name for p in logs] == ["fo-125m-gbs2-ngbs1-prompt8-gen6-percent-100-0-100-0-100-0-gpu-cache-compc.log"]
    assert json.loads(logs[0].read_text())["projected"] is False
    assert cli.main(BASE + ["--log-file", "auto", "--no-log"]) == 0
    assert "total" in capsys.readouterr().out  # --verbose 2 (default): the summary
    assert len(list(tmp_path.glob("*.log"))) == 1  # --no-log wrote nothing


def test_h2o_suite_abbreviations(capsys):
    """The H2O authors' benchmark commands abbreviate flags as their argparse allowed (`--debug fewer_batch`,
    `--cpu`): --debug is --debug-mode here too; --cpu is ambiguous here (--cpu-cache-compute, --cpu-mem), so it is
    refused in one line naming both."""
    assert _rc(["--gen-len", "32", "--debug", "fewer_batch"])[1].measured_steps == FEWER_BATCH_STEPS
    _refused(capsys, ["--cpu"], "--cpu-cache-compute", "--cpu-mem")
