"""A family module registers itself by declaring FAMILIES: models.FAMILY_MODULES is every module of flexh2o/models
that declares some (no hand-written table), and flexh2o-convert --help reads the same names from their source
without importing torch."""
from __future__ import annotations

import importlib
import os

from flexh2o import models
from flexh2o.cli.help_text import declared_families


def test_the_table_is_every_module_that_declares_families():
    folder = os.path.dirname(models.__file__)
    declaring = {f"flexh2o.models.{f[:-3]}" for f in os.listdir(folder) if f.endswith(".py") and f != "__init__.py"
                 and hasattr(importlib.import_module(f"flexh2o.models.{f[:-3]}"), "FAMILIES")}
    assert {m.__name__ for m in models.FAMILY_MODULES} == declaring
    assert len(models.FAMILY_MODULES) == len(declaring) >= 4


def test_help_names_the_registry_in_its_order():
    assert declared_families() == list(models.family_names())


def test_a_new_module_is_listed_after_the_named_ones(tmp_path):
    """A new family's module (any file name) is found with no table edited: after LISTED_FIRST's, by file name; a
    module without FAMILIES (shared code) names none; a Family given name= counts too."""
    (tmp_path / "__init__.py").write_text('LISTED_FIRST = ("zeta", "alpha")\n')
    (tmp_path / "alpha.py").write_text('FAMILIES = (Family("a1"), Family(name="a2", facts={}))\n')
    (tmp_path / "zeta.py").write_text('X = 1\nFAMILIES = (Family("z"),)\n')
    (tmp_path / "beta.py").write_text('FAMILIES = (Family("b"),)\n')
    (tmp_path / "common.py").write_text('def f():\n    return Family("not a declaration")\n')
    assert declared_families(str(tmp_path)) == ["z", "a1", "a2", "b"]
    assert sorted(["toy", "gemma", "opt", "abc"], key=models.listing_order) == ["opt", "gemma", "abc", "toy"]
