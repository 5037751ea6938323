"""The package's shape: no import cycle between flexh2o modules (imports at module level, where cycles break
loading), and every module importable on its own."""
from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import flexh2o

ROOT = Path(flexh2o.__file__).parent


def _modules() -> dict:
    """module name -> path of every module in the package."""
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _top_level_imports(path: Path, known: set) -> set:
    """flexh2o modules imported by statements at module level (not inside functions)."""
    got = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        got |= {n for n in names if n in known}
    return got


def _cycle(graph: dict):
    """One cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        state[m] = "done"
        stack.pop()
        return None
    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycle():
    mods = _modules()
    graph = {m: _top_level_imports(p, set(mods)) - {m} for m, p in mods.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("name", sorted(m.name for m in pkgutil.walk_packages(flexh2o.__path__, "flexh2o.")
                                        if not m.name.endswith("__main__")))
def test_every_module_imports(name):
    importlib.import_module(name)


def test_every_package_folder_is_installed():
    # setup.cfg's `packages = find:` only installs folders with an __init__.py (a non-editable install of a folder
    # without one fails with ModuleNotFoundError); data folders (configs, texts) hold no .py files
    missing = [str(d.relative_to(ROOT.parent)) for d in ROOT.rglob("*") if d.is_dir() and d.name != "__pycache__"
               and any(d.glob("*.py")) and not (d / "__init__.py").exists()]
    assert not missing, missing
