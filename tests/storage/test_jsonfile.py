"""jsonfile.write_json: a JSON file is replaced whole or not at all; no temporary file is left behind."""
from __future__ import annotations

import json
import os

import pytest

from flexh2o.jsonfile import read_json, write_json


def test_write_json_replaces_the_file_whole(tmp_path):
    path = str(tmp_path / "out.json")
    write_json(path, {"a": 1}, indent=1)
    write_json(path, [1, 2])
    assert read_json(path, "fix", list) == [1, 2] and os.listdir(tmp_path) == ["out.json"]


def test_an_interrupted_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = str(tmp_path / "out.json")
    write_json(path, {"old": True})
    with pytest.raises(TypeError):
        write_json(path, {"new": object()})  # not serialisable: fails half-way through the dump
    assert json.load(open(path)) == {"old": True} and os.listdir(tmp_path) == ["out.json"]
