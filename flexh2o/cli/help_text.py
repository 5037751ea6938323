"""What --help shows: every option's default (argparse's ArgumentDefaultsHelpFormatter, without repeating a default
the help text already states, and with lists shown as they are typed), and the built-in model names from the one
size table (config.MODEL_SIZES)."""
from __future__ import annotations

import argparse
from typing import Optional

NO_DEFAULT_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction,
                      argparse._VersionAction, argparse._SubParsersAction)


def shown_default(action: argparse.Action):
    """The default as a user would type it (None: the option has no default worth showing: it is off, or unset)."""
    if not action.option_strings or isinstance(action, NO_DEFAULT_ACTIONS):
        return None
    value = action.default
    if value is None or value is argparse.SUPPRESS:
        return None
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


class HelpFormatter(argparse.HelpFormatter):
    """Appends ' (default: X)' to an option's help unless the text already says what its default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = shown_default(action)
        if shown is None or "default" in text.lower():
            return text
        return f"{text} (default: {shown.replace('%', '%%')})"


def model_help(default: Optional[str], extra: str = "") -> str:
    """--model's help: the bundled real model, the built-in names with seeded random weights (the size table's),
    the default (None: the flag is required) and what else is accepted."""
    from flexh2o.config import BUNDLED, MODEL_SIZES  # in the table's order: by family, then size
    given = f"default {default}" if default else "required"
    real = ", ".join(f"{k} ({v})" for k, v in BUNDLED.items())
    return (f"{real}; or a built-in name with seeded random weights: {', '.join(MODEL_SIZES)} (facebook/ prefix "
            f"accepted; {given})" + (f"; {extra}" if extra else ""))


def declared_families(folder: Optional[str] = None) -> list:
    """The model families flexh2o runs, in the registry's order (models.family_names()), read from the source of
    flexh2o/models (or `folder`): each `Family("name", ...)` of a module's FAMILIES, the modules ordered as
    models.listing_order orders them. Importing the family modules would import torch, over a second, for a --help."""
    import ast
    import importlib.util
    import os
    folder = folder or importlib.util.find_spec("flexh2o.models").submodule_search_locations[0]
    first = _literal(os.path.join(folder, "__init__.py"), "LISTED_FIRST")
    names = sorted((f[:-3] for f in os.listdir(folder) if f.endswith(".py") and f != "__init__.py"),
                   key=lambda m: (m not in first, first.index(m) if m in first else 0, m))
    out = []
    for module in names:
        with open(os.path.join(folder, module + ".py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FAMILIES" for t in node.targets):
                out += [_family_name(call) for call in ast.walk(node.value)
                        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "Family"]
    return out


def _family_name(call) -> str:
    """The name a `Family(...)` call declares: its first argument, or name=."""
    import ast
    node = call.args[0] if call.args else next(k.value for k in call.keywords if k.arg == "name")
    return ast.literal_eval(node)


def _literal(path: str, name: str):
    """The value of a module-level `name = <literal>` in the source file at `path`."""
    import ast
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return next(ast.literal_eval(n.value) for n in tree.body
                if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == name for t in n.targets))
