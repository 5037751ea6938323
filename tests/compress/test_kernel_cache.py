"""numba's on-disk cache of the fused cache kernels is keyed by every kernel file's source (compress/kernel_cache.py):
a change to a file that is only inlined into another's kernels (fused_kernels.py into fused_decode_kernels.py) finds
a fresh cache folder, where numba's own key (the defining file's stamp) kept the old machine code."""
from __future__ import annotations

import importlib.util
import os
import shutil

import pytest

from flexh2o.compress import kernel_cache as kc

numba = pytest.importorskip("numba")

KERNEL = "import numba\n\n\n@numba.njit(cache=True)\ndef plus_one(x):\n    return x + 1\n"


def _copies(tmp_path) -> str:
    """A folder holding copies of the kernel files (edited by the tests, never the package's)."""
    folder = tmp_path / "src"
    folder.mkdir()
    for name in kc.KERNEL_FILES:
        shutil.copy(os.path.join(kc.HERE, name), folder / name)
    return str(folder)


def _define(path: str):
    """Import the module at `path` (numba picks its kernel's cache folder here) -> its kernel."""
    spec = importlib.util.spec_from_file_location(f"kern_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.plus_one


def _indexed(folder: str) -> bool:
    """Whether numba cached a kernel in `folder` (its index files)."""
    return any(n.endswith(".nbi") for _, _, names in os.walk(folder) for n in names)


def test_an_inlined_files_change_gives_a_fresh_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    src = _copies(tmp_path)
    kern = tmp_path / "kern.py"
    kern.write_text(KERNEL)
    before = numba.config.CACHE_DIR
    with kc.kernel_cache(src) as first:
        f = _define(str(kern))
    assert numba.config.CACHE_DIR == before  # numba's setting restored
    assert first == kc.cache_folder(kc.sources_key(src)) and first.startswith(str(tmp_path / "numba"))
    assert f(1) == 2 and f._cache._cache_path.startswith(first)  # compiled and cached in the keyed folder
    assert _indexed(first)
    with open(os.path.join(src, "fused_kernels.py"), "a") as fh:  # only the inlined file changes
        fh.write("\n# changed\n")
    with kc.kernel_cache(src) as second:
        g = _define(str(kern))
    assert second != first and not _indexed(second)  # nothing cached there yet: compiled anew
    assert g(1) == 2 and g._cache._cache_path.startswith(second) and _indexed(second)
    with open(os.path.join(src, "fused_decode_kernels.py"), "a") as fh:  # the defining file too
        fh.write("\n# changed\n")
    assert kc.sources_key(src) not in (os.path.basename(first), os.path.basename(second))
    assert kc.cache_folder(kc.sources_key(src)) not in (first, second)


def test_the_key_is_the_sources(tmp_path, monkeypatch):
    """The same bytes give the same folder (a second process finds the kernels); a user's NUMBA_CACHE_DIR holds it."""
    src = _copies(tmp_path)
    assert kc.sources_key(src) == kc.sources_key(kc.HERE) == kc.sources_key()
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "mine"))
    assert kc.cache_folder("k") == str(tmp_path / "mine" / "numba-kernels-k")
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    assert os.path.dirname(kc.cache_folder("k")) in (os.path.join(kc.HERE, "__pycache__"),
                                                      os.path.join(kc.cache_dir(), "numba"))


def test_the_kernel_modules_are_imported_inside_it(monkeypatch):
    """The three places that import the kernel modules (fused_check.load, fused_write's and fused_decode's loaders)
    do it inside kernel_cache (stand-in modules here, so that nothing compiles)."""
    import contextlib
    import types

    from flexh2o import compress
    from flexh2o.compress import fused_check, fused_decode, fused_write

    entered = []

    @contextlib.contextmanager
    def recording(folder: str = kc.HERE):
        entered.append(folder)
        yield kc.cache_folder("test")

    monkeypatch.setattr(kc, "kernel_cache", recording)
    fakes = {n: types.ModuleType(n) for n in ("fused_kernels", "fused_quant_kernels", "fused_decode_kernels")}
    for name, fake in fakes.items():
        monkeypatch.setattr(compress, name, fake, raising=False)
    assert fused_check.load(lambda kn: None)[0] is fakes["fused_kernels"] and len(entered) == 1
    assert fused_write._loaded.__wrapped__("auto") is None and len(entered) == 3  # load's, then its own
    assert fused_decode.kernel.__wrapped__() is None and len(entered) == 4  # the stand-in fails its check
