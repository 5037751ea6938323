"""--help of every console script (setup.cfg's entry points): every option says what it does, and every option with
a default shows that default (as a user types it); --model lists the built-in names of the one size table."""
from __future__ import annotations

import argparse
import configparser
import importlib
import os
import re
import subprocess
import sys

import pytest

from flexh2o.config import model_names

ROOT = os.path.abspath(os.path.join(__file__, "../../.."))
FLAG_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction)


def _entry_points() -> list:
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    lines = [x for x in cfg["options.entry_points"]["console_scripts"].splitlines() if x.strip()]
    return [tuple(p.strip() for p in line.split("=")) for line in lines]


def _commands() -> list:
    """(script, module, subcommand or None) for every console script and each of its subcommands."""
    out = []
    for script, target in _entry_points():
        module = target.split(":")[0]
        parser = importlib.import_module(module).build_parser()
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        out += [(script, module, s) for s in subs[0].choices] if subs else [(script, module, None)]
    return out


def _parser(module: str, sub):
    parser = importlib.import_module(module).build_parser()
    if sub is None:
        return parser
    return [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)][0].choices[sub]


def _help_blocks(text: str) -> dict:
    """{first option string: the option's lines of --help joined with single spaces}."""
    blocks, key = {}, None
    for line in text.splitlines():
        if re.match(r"^  -", line):
            key = line.split()[0].rstrip(",")
            blocks[key] = line.strip()
        elif key and re.match(r"^   +\S", line):
            blocks[key] += " " + line.strip()
        else:
            key = None
    return {k: " ".join(v.split()) for k, v in blocks.items()}


def _typed_forms(value) -> set:
    """The ways a default may be written in help text."""
    if isinstance(value, (list, tuple)):
        items = [str(x) for x in value]
        return {" ".join(items), ",".join(items), ", ".join(items)}
    forms = {str(value), str(value).lower()}
    if isinstance(value, float):
        forms.add(f"{value:g}")
    return forms


def _has_default(action: argparse.Action) -> bool:
    return not isinstance(action, FLAG_ACTIONS) and action.default not in (None, argparse.SUPPRESS)


@pytest.fixture(scope="module")
def helps() -> dict:
    """{(module, sub): the console script's --help text}, each run as its own process."""
    env = dict(os.environ, COLUMNS="100")
    procs = {(module, sub): subprocess.Popen([sys.executable, "-m", module] + ([sub] if sub else []) + ["--help"],
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _, module, sub in _commands()}
    out = {}
    for key, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        out[key] = stdout
    return out


def test_every_console_script_is_covered():
    scripts = {s for s, _, _ in _commands()}
    assert {"flexh2o-run", "flexh2o-convert", "flexh2o-profile", "flexh2o-plan", "flexh2o-eval"} <= scripts
    assert {(m, s) for _, m, s in _commands() if s} == {("flexh2o.cli.eval", "ppl"), ("flexh2o.cli.eval", "recall")}


@pytest.mark.parametrize("script,module,sub", _commands())
def test_every_option_says_what_it_does_and_its_default(helps, script, module, sub):
    parser = _parser(module, sub)
    blocks = _help_blocks(helps[(module, sub)])
    formatter = parser._get_formatter()
    missing_help, missing_default = [], []
    for action in parser._actions:
        if not action.option_strings:
            continue
        block = blocks[action.option_strings[0]]
        invocation = " ".join(formatter._format_action_invocation(action).split())
        assert block.startswith(invocation), (block, invocation)
        text = block[len(invocation):].strip()
        if not text:
            missing_help.append(action.option_strings[-1])
        elif _has_default(action) and ("default" not in text.lower()
                                       or not any(f in text for f in _typed_forms(action.default))):
            missing_default.append(f"{action.option_strings[-1]} (default {action.default!r}): {text}")
    assert not missing_help, f"{script} {sub or ''}: options without help text: {missing_help}"
    assert not missing_default, f"{script} {sub or ''}: help without its default: {missing_default}"


@pytest.mark.parametrize("module", ["flexh2o.cli.run", "flexh2o.cli.plan"])
def test_model_help_lists_every_built_in_name(helps, module):
    block = _help_blocks(helps[(module, None)])["--model"]
    names = model_names()
    assert "smollm2-135m" in names and "opt-30b" in names
    for name in names:
        assert re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])", block), (name, block)


def test_a_default_with_a_percent_sign_is_shown_as_typed():
    from flexh2o.cli.console import Parser
    p = Parser(prog="x")
    p.add_argument("--share", default="20%", help="a share")
    p.add_argument("--shares", nargs="+", default=["1", "2"], help="shares")
    p.add_argument("--on", action="store_true", help="a switch")
    blocks = _help_blocks(p.format_help())
    assert blocks["--share"].endswith("a share (default: 20%)")
    assert blocks["--shares"].endswith("shares (default: 1 2)")
    assert blocks["--on"] == "--on a switch"  # a switch is off unless given: nothing to show
