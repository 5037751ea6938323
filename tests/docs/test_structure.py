"""The house's shape, as rules over every flexh2o module (today's and tomorrow's): imports run down the layers and
never in a circle, counting imports inside functions too, and no two folders import each other; no module over
MAX_LINES lines; every package folder named in the design map (docs/architecture.md)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from test_package import ROOT, _cycle, _modules

MAX_LINES = 300

# Top to bottom: a module may import its own layer or those below it, never one above. A layer is named by the first
# part of a module's path under flexh2o/ (a folder or a module); `__main__` modules are entry points wherever they are.
LAYERS = (
    ("entry points", {"cli", "__main__", "api", ""}),  # "": the package itself (flexh2o.LLM, lazily)
    ("tools that run the engine", {"tuning", "eval", "serve"}),
    ("jobs", {"job", "pipeline", "batch"}),
    ("the engine", {"engine", "generation"}),
    ("the runtime plan", {"planning", "run_config"}),
    ("the run's parts", {"weights", "kv", "models", "placement", "schedule"}),
    ("tiers and codecs", {"storage", "compress"}),
    ("leaves", {"config", "units", "dtypes", "tensors", "jsonfile", "tokenizer", "prompts", "sampling", "metrics",
                "errors", "requests", "chat", "paths", "flag"}),
)


def imports_of(module: str, path: Path, known: set) -> set:
    """flexh2o modules that `module` imports anywhere in its file: at module level and inside functions, absolute
    or relative ("from flexh2o.x import y" counts flexh2o.x, and flexh2o.x.y where that is a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    got = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        got |= {n for n in names if n in known}
    return got - {module, "flexh2o"}  # the root package's __init__ holds nothing


def import_graph() -> dict:
    mods = _modules()
    return {m: imports_of(m, p, set(mods)) for m, p in mods.items()}


def layer_of(module: str) -> int:
    """Index in LAYERS (0 = top) of a flexh2o module; ValueError names a module in no layer."""
    parts = module.split(".")[1:]
    key = "__main__" if parts and parts[-1] == "__main__" else (parts[0] if parts else "")
    for i, (_, names) in enumerate(LAYERS):
        if key in names:
            return i
    raise ValueError(f"{module} is in no layer: add {key!r} to LAYERS in tests/docs/test_structure.py")


def upward_imports(graph: dict) -> list:
    """'a (layer) -> b (layer)' for every import from a lower layer to a higher one."""
    return [f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})"
            for a, targets in sorted(graph.items()) for b in sorted(targets) if layer_of(b) < layer_of(a)]


def test_no_import_cycle_counting_imports_inside_functions():
    graph = import_graph()
    found = _cycle(graph)
    assert found is None, " -> ".join(found)


def test_every_module_is_in_a_layer():
    missing = []
    for m in sorted(_modules()):
        if m == "flexh2o":
            continue
        try:
            layer_of(m)
        except ValueError as e:
            missing.append(str(e))
    assert not missing, "\n".join(missing)


def test_no_import_runs_up_a_layer():
    up = upward_imports(import_graph())
    assert not up, "imports from a lower layer to a higher one:\n" + "\n".join(up)


def folder_of(module: str) -> str:
    """The folder (or top-level module) of flexh2o/ that holds a module: flexh2o.kv.policies.h2o -> 'kv'."""
    parts = module.split(".")[1:]
    return parts[0] if parts else ""


def folder_graph(graph: dict) -> dict:
    """The import graph between folders: 'a' -> 'b' when a module under a imports one under b."""
    out: dict = {folder_of(m): set() for m in graph}
    for a, targets in graph.items():
        out[folder_of(a)] |= {folder_of(b) for b in targets} - {folder_of(a)}
    return out


def package_graph(graph: dict) -> dict:
    """The import graph between package folders at every depth ('flexh2o.kv' -> 'flexh2o.kv.policies'), the
    top-level modules of flexh2o/ left out (they are the layers' own modules, checked by the folder graph)."""
    mods = _modules()

    def package(m):
        return m if mods[m].name == "__init__.py" else m.rpartition(".")[0]
    out: dict = {package(m): set() for m in graph if package(m) != "flexh2o"}
    for a, targets in graph.items():
        if package(a) != "flexh2o":
            out[package(a)] |= {package(b) for b in targets} - {package(a), "flexh2o"}
    return out


def test_no_two_folders_import_each_other():
    """A `__main__` or a function-level import counts too: the folders form no circle, neither the top-level ones
    nor a folder and the folders inside it (kv/ and kv/policies/)."""
    graph = import_graph()
    for folders in (folder_graph(graph), package_graph(graph)):
        found = _cycle(folders)
        assert found is None, " -> ".join(found)


def test_the_folder_graph_sees_a_circle_through_any_modules():
    graph = {"flexh2o.eval.__main__": {"flexh2o.cli.eval"}, "flexh2o.cli.eval": {"flexh2o.eval.common"},
             "flexh2o.eval.common": set()}
    assert folder_graph(graph) == {"eval": {"cli"}, "cli": {"eval"}}
    assert _cycle(folder_graph(graph)) == ["cli", "eval", "cli"]


def test_the_graph_sees_imports_inside_functions_and_relative_ones(tmp_path):
    pkg = tmp_path / "flexh2o"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "a.py").write_text("def f():\n    from flexh2o.cli import run\n    from . import b\n")
    known = {"flexh2o.cli", "flexh2o.cli.run", "flexh2o.sub.b", "flexh2o.sub.a"}
    assert imports_of("flexh2o.sub.a", pkg / "sub" / "a.py", known) == {"flexh2o.cli", "flexh2o.cli.run",
                                                                         "flexh2o.sub.b"}
    up = upward_imports({"flexh2o.units": {"flexh2o.cli.run"}, "flexh2o.cli.run": {"flexh2o.units"}})
    assert up == ["flexh2o.units (leaves) -> flexh2o.cli.run (entry points)"]
    with pytest.raises(ValueError, match="no layer"):
        layer_of("flexh2o.somewhere_new")


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py")))
def test_no_module_over_max_lines(path):
    lines = len((ROOT.parent / path).read_text().splitlines())
    assert lines <= MAX_LINES, f"{path} has {lines} lines (at most {MAX_LINES}): split it by responsibility"


def package_folders() -> list:
    """Every package folder under flexh2o/ (an __init__.py inside), as a path like 'kv/policies'."""
    return sorted(str(d.parent.relative_to(ROOT)) for d in ROOT.rglob("__init__.py") if d.parent != ROOT)


def design_map() -> str:
    """The design map: the '## Design' section of docs/architecture.md (moved there from the README)."""
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    start = text.index("\n## Design")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def test_the_readme_design_map_names_every_package_folder():
    text = design_map()
    missing = [f"{d}/" for d in package_folders() if f"`{d}/" not in text]
    assert not missing, f"docs/architecture.md's design map does not name {', '.join(missing)}: add a row for each"
