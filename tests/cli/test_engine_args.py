"""EngineArgs (cli/engine_args.py): flexh2o-run's options are generated from its fields' Flags, and the Python API
fills it from keywords directly, each value what the flag parses it to: the same EngineArgs as parsing the command
line those keywords stand for (api.option_argv), and the same refusal, word for word, for a bad value."""
from __future__ import annotations

import dataclasses

import pytest

from flexh2o.api import NOT_OPTIONS, option_argv
from flexh2o.cli import run as cli
from flexh2o.cli.engine_args import EngineArgs

OPTION_SETS = [
    {},
    {"percent": (0, 100, 100, 0), "gpu_batch_size": 2, "overlap": False, "no_warmup": True},
    {"kv_policy": "h2o", "hh_ratio": 0.2, "num_sinks": 4, "seed": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 3},
    {"compress_cache": True, "cache_rotate": False, "cache_keys": "channel", "compress_bits": 4, "eos_id": 3},
    {"eos_id": [1, 2], "overlap": "false", "pin_weight": True, "gpu_batch_size": "auto", "verbose": 0},
    {"cpu_cache_compute": 0, "ignore_eos": 1, "kv_budget": 16, "dtype": "float32", "hh_all": True},
]


def _parsed(options: dict) -> EngineArgs:
    parser = cli.build_parser()
    return EngineArgs.from_namespace(parser.parse_args(option_argv(parser, options)))


def test_the_flags_are_the_fields():
    """Every option of flexh2o-run's parser is one field's Flag: the same name, default, help, type, choices and
    nargs, in the same order; the parser's defaults are EngineArgs()."""
    actions = [a for a in cli.build_parser()._actions if a.option_strings and a.dest != "help"]
    flags = EngineArgs.flags()
    assert [a.option_strings[0] for a in actions] == [f.flag for f in flags]
    listed = lambda choices: None if choices is None else list(choices)  # noqa: E731
    for a, f in zip(actions, flags):
        assert (a.dest, a.default, a.help, a.type, listed(a.choices), a.nargs) == (
            f.dest, f.default, f.help, f.type, listed(f.choices), f.nargs if f.action is None else a.nargs), f.flag
    assert [f.name for f in dataclasses.fields(EngineArgs)] == [f.dest for f in flags]
    assert _parsed({}) == EngineArgs()


@pytest.mark.parametrize("options", OPTION_SETS)
def test_keywords_fill_what_the_command_line_parses(options):
    got = EngineArgs.from_options(options, NOT_OPTIONS)
    assert got == _parsed(options)
    assert dataclasses.replace(got) is not got and EngineArgs().percent is not EngineArgs().percent  # own lists


@pytest.mark.parametrize("options", [{"temperature": "x"}, {"kv_policy": "nope"}, {"overlap": "maybe"},
                                     {"gen_len": 1.5}, {"cache_keys": "rows"}, {"gen_len": [1, 2]},
                                     {"eos_id": []}, {"compress_bits": 5}])
def test_a_bad_value_is_refused_in_the_parsers_words(options):
    with pytest.raises(ValueError) as parsed:
        _parsed(options)
    with pytest.raises(ValueError) as filled:
        EngineArgs.from_options(options, NOT_OPTIONS)
    assert str(filled.value) == str(parsed.value)


@pytest.mark.parametrize("key", ["colour", "prompt_file", "dry_run"])
def test_an_unknown_or_refused_keyword_names_itself(key):
    with pytest.raises(ValueError, match=f"unknown option '{key}'.*gen_len"):
        EngineArgs.from_options({key: 1}, NOT_OPTIONS)


def test_a_parser_with_more_options_gives_its_run_options():
    """flexh2o-serve's parser adds its own options (--port, ...): from_namespace keeps the run's."""
    parser = cli.build_parser()
    parser.add_argument("--port", type=int, default=8000)
    assert EngineArgs.from_namespace(parser.parse_args(["--port", "1", "--gen-len", "4"])) == EngineArgs(gen_len=4)


def test_a_repeated_flag_takes_each_value():
    """--prompt (repeatable): prompt=[...] is each --prompt given once; one string is one prompt."""
    parsed = EngineArgs.from_namespace(cli.build_parser().parse_args(["--prompt", "a b", "--prompt", "c"]))
    assert EngineArgs.from_options({"prompt": ["a b", "c"]}) == parsed
    assert EngineArgs.from_options({"prompt": "a b"}).prompt == ["a b"]
