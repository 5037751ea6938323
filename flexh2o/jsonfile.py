"""Reading a JSON file named on the command line, with a one-line error naming the file and its fix; writing one
atomically."""
from __future__ import annotations

import json
import os
import tempfile


def read_json(path: str, fix: str, kind: type = object):
    """The JSON value in `path`, which must be a `kind` (dict, list; default anything). ValueError, one line:
    `path`, what is wrong with it, then `fix` (what the user should do)."""
    try:
        with open(path) as f:
            value = json.load(f)
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror or e}): {fix}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else f"not valid JSON: {e}"
        raise ValueError(f"{path} is corrupt ({why}): {fix}") from None
    if not isinstance(value, kind):
        raise ValueError(f"{path} does not hold a JSON {kind.__name__}: {fix}")
    return value


def write_json(path: str, value, indent=None) -> None:
    """`value` as JSON into `path`, through a temporary file in the same folder renamed over it: a reader never sees
    a half-written file, and an interrupted write leaves the old file (or none) and no temporary behind."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".flexh2o-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(value, f, indent=indent)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
