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
