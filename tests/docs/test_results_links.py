"""The benchmark documents point at files that exist: every `results/...` path cited in RESULTS.md, ACCURACY.md, their
archived logs, docs/, the README and the benchmark scripts names at least one file (a {a,b} list or glob: each
alternative; a `{name}` placeholder: any), every relative Markdown link names a file, every in-page link an anchor;
and benchmarks/results/ holds only question folders, each named in its README."""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
CITING = sorted([*BENCH.glob("*.md"), *BENCH.glob("archive/*.md"), *BENCH.glob("*.py"), *ROOT.glob("docs/*.md"),
                 ROOT / "README.md", RESULTS / "README.md"])
CITED = re.compile(r"results/([A-Za-z0-9_.*{},/\-]+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def alternatives(pattern: str) -> list:
    """'a_{x,y}.json' -> ['a_x.json', 'a_y.json']; a placeholder '{T}' (no comma) becomes '*'."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    alts = m.group(1).split(",") if "," in m.group(1) else ["*"]
    return [x for alt in alts for x in alternatives(pattern[:m.start()] + alt + pattern[m.end():])]


def matches(pattern: str, files: list) -> bool:
    if pattern.endswith("/"):
        return any(f.startswith(pattern) for f in files)
    return any(fnmatch.fnmatchcase(f, pattern) or f.startswith(pattern + "/") for f in files)


def cited(path: Path) -> list:
    """The results/ patterns `path` cites (a sentence's trailing '.' or ',' left off)."""
    out = []
    for m in CITED.finditer(path.read_text()):
        p = m.group(1)
        while p[-1] in ".," and p.count("{") == p.count("}"):
            p = p[:-1]
        out.append(p)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def result_files() -> list:
    return sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file())


@pytest.mark.parametrize("path", [str(p.relative_to(ROOT)) for p in CITING])
def test_every_cited_result_file_exists(path):
    files = result_files()
    missing = sorted({f"{p} ({alt})" for p in cited(ROOT / path) for alt in alternatives(p) if not matches(alt, files)})
    assert not missing, f"{path} cites result files that do not exist: {missing}"


@pytest.mark.parametrize("path", [str(p.relative_to(ROOT)) for p in CITING if p.suffix == ".md"])
def test_every_markdown_link_resolves(path):
    doc = ROOT / path
    text = doc.read_text()
    anchors = set(re.findall(r'id="([^"]+)"', text)) | {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        file, _, anchor = target.partition("#")
        if file and not (doc.parent / file).exists():
            broken.append(target)
        elif not file and anchor not in anchors:
            broken.append(target)
    assert not broken, f"{path} links to what does not exist: {broken}"


def test_results_hold_only_question_folders_each_named_in_the_readme():
    readme = (RESULTS / "README.md").read_text()
    loose = [p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md"]
    assert not loose, f"result files outside a question folder: {loose}: put each in its question's folder"
    unnamed = [p.name for p in RESULTS.iterdir() if p.is_dir() and f"`{p.name}/`" not in readme]
    assert not unnamed, f"benchmarks/results/README.md does not name {unnamed}: add a row with its question"


def test_the_checks_see_a_missing_file_and_expand_lists():
    files = ["peers/compare_disk.jsonl", "peers/fair_x/records.jsonl"]
    assert alternatives("a_{x,y}_{T}.json") == ["a_x_*.json", "a_y_*.json"]
    assert matches("peers/compare_*.jsonl", files) and matches("peers/fair_x/", files)
    assert matches("peers/fair_x", files) and not matches("peers/compare_memory.jsonl", files)
    assert slug("The fused cache attention (`compress/fused_attend.py`): why numba") == \
        "the-fused-cache-attention-compressfused_attendpy-why-numba"
