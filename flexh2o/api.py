"""The Python API: `LLM(model, **options).generate(prompts, SamplingParams(...))`.

Options are flexh2o-run's flags as keywords (`percent=(0, 100, 100, 0)`, `kv_policy="h2o"`, `hh_ratio=0.2`,
`gpu_batch_size=8`, ...): they fill an EngineArgs (cli/engine_args.py, where every option is declared once and
flexh2o-run's flags are generated from), each value what its flag would parse it to, checked by flexh2o-run's own
checks, so the names, defaults and refusals are the command line's. Prompts become requests
through the same code as a .jsonl --prompt-file's lines (requests.py), and run like a request job: each row stops at
EOS (unless ignore_eos), a stop string or max_tokens. The first generate() call builds the engine (weights loaded
once) and later calls reuse it while their run fits its plan (`serves`); `close()` or a with-block frees it.
"""
from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass
from typing import Optional, Sequence

NOT_OPTIONS = ("prompt_file", "output_file", "resume", "dry_run", "policy", "max_seqs", "stage_layers",
               "stage_timeout", "cut_gen_len", "debug_mode", "prompt", "chat")  # a file-based or one-off run's


@dataclass(frozen=True)
class SamplingParams:
    """Per-call generation settings; None takes the LLM's (flexh2o-run's --gen-len, --temperature, ...)."""

    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    top_k: Optional[int] = None  # sample from the k most likely tokens (0: all), with temperature > 0
    stop: Sequence[str] = ()  # a string alone is one stop string (as vLLM takes it), not its characters
    ignore_eos: Optional[bool] = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))


def option_argv(parser: argparse.ArgumentParser, options: dict) -> list:
    """Keyword options -> the flexh2o-run arguments that give them (ValueError naming an unknown keyword): the
    command line of an LLM's options (EngineArgs.from_options fills them without one)."""
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    argv = []
    for key, value in options.items():
        action = actions.get(key)
        if action is None or key in NOT_OPTIONS:
            known = ", ".join(sorted(k for k in actions if k not in NOT_OPTIONS and k != "help"))
            raise ValueError(f"unknown option {key!r}: LLM takes flexh2o-run's flags as keywords ({known})")
        flag = action.option_strings[-1]
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x: the one the value names
            argv += [] if value is None else [action.option_strings[0 if value else 1]]
        elif action.nargs == 0:  # store_true
            argv += [flag] if value else []
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif value is not None:
            argv += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


def _api_names(method):
    """A ValueError from `method` in the API's own names: flexh2o-run's flags become the keywords that set them
    (--hh-ratio -> hh_ratio, --tokenizer -> tokenizer) and a request line's max_new_tokens becomes max_tokens."""
    import functools

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except ValueError as e:
            raise ValueError(api_message(str(e))) from None
    return wrapped


def api_message(text: str) -> str:
    """`text` (a CLI or request-file message) in the API's names."""
    import re
    from flexh2o.cli.engine_args import run_flags
    flags = sorted({f.flag for f in run_flags()} | {"--help"}, key=len, reverse=True)  # a later policy's flags too
    for flag in flags:
        name = flag[2:].replace("-", "_")
        text = re.sub(re.escape(flag) + r"(?: (?=[A-Z0-9.-])|(?=\)))", name + "=", text)  # hh_ratio=1.5, (tokenizer=)
        text = re.sub(re.escape(flag) + r"(?![\w-])", name, text)
    return re.sub(r"\bmax_new_tokens\b", "max_tokens", text)


class LLM:
    """A model and its run options; generate() answers a list of prompts (text or token-id lists)."""

    @_api_names
    def __init__(self, model: str = "opt-125m", **options):
        from flexh2o.cli.checks import check_run_flags
        from flexh2o.cli.engine_args import EngineArgs
        from flexh2o.cli.flexgen_flags import flexgen_options
        from flexh2o.prompts import load_tokenizer
        path, tokenizer = _model_source(model)
        if path is not None:
            options = {"path": path, "tokenizer": tokenizer, **options}
        else:
            options = {"model": model, **options}
        self.args = EngineArgs.from_options(options, NOT_OPTIONS)
        check_run_flags(self.args)
        _budget_warning(self.args.kv_budget)
        self.opts = flexgen_options(self.args)
        self.cfg = _model_config(self.args)
        self.tokenizer = load_tokenizer(self.args.tokenizer)
        self.engine = None  # built by the first generate() and kept (weights loaded once) until close()

    def close(self) -> None:
        """Free the kept engine (its tiers and files); a later generate() builds it again."""
        eng, self.engine = getattr(self, "engine", None), None
        if eng is not None:
            eng.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    def generate(self, prompts: Sequence, params=None) -> list:
        """One Result (batch/stopping.py: text, token_ids, finish_reason, ...) per prompt, in order. params: a
        SamplingParams for every prompt, or a list of them, one per prompt (as vLLM takes them)."""
        return self._generate(prompts, params)

    def chat(self, conversations: Sequence, params=None) -> list:
        """One Result per conversation, in order: each a list of {"role", "content"} messages (or one conversation
        alone) rendered with the model's chat template and answered as the assistant's next turn. params: as
        generate() takes them, one per conversation."""
        return self._generate(_conversations(conversations), params, chat=True)

    @_api_names
    def _generate(self, prompts: Sequence, params, chat: bool = False) -> list:
        from flexh2o.batch.progress import Progress
        from flexh2o.batch.run import run_requests
        from flexh2o.cli.request_job import stop_rule
        from flexh2o.cli.configure import build_run_config
        prompts = _prompt_list(prompts)
        per = _per_prompt(params, len(prompts))
        reqs = self.requests(prompts, per, chat)
        args = copy.copy(self.args)
        args.gen_len = max(r.max_new_tokens for r in reqs)
        ignore = {self.args.ignore_eos if p.ignore_eos is None else p.ignore_eos for p in per}  # None: the LLM's
        if len(ignore) > 1:
            raise ValueError("params: ignore_eos differs between prompts; it holds for a whole generate() call: give "
                             "every prompt the same, or generate them in separate calls")
        args.ignore_eos = ignore.pop()
        rc = build_run_config(args, self.cfg, [list(r.prompt_ids) for r in reqs])
        warm = self.engine is None or not serves(self.engine.rc, rc)
        if warm:  # the first call, or one the kept engine's plan cannot serve: (re)build it
            self.close()
            from flexh2o.engine import Engine
            self.engine = Engine(rc)
        with Progress(len(reqs), enabled=self.opts.verbose >= 1) as bar:
            rule = stop_rule(args, self.cfg, self.tokenizer, self.chat_template)
            stats = run_requests(self.engine.rc, reqs, rule, progress=bar,
                                 warmup=warm and not args.no_warmup, refill=not args.no_refill,
                                 engine=self.engine)
        order = {r.id: i for i, r in enumerate(reqs)}
        return sorted(stats.results, key=lambda res: order[res.id])

    @property
    def chat_template(self):
        """The model's ChatTemplate (chat.py), or None when it keeps none."""
        if not hasattr(self, "_chat_template"):
            from flexh2o.cli.request_job import chat_template_of
            self._chat_template = chat_template_of(self.args, self.tokenizer)
        return self._chat_template

    @_api_names
    def requests(self, prompts: Sequence, params, chat: bool = False) -> list:
        """The prompts (chat: conversations) as requests '0', '1', ..., checked as a .jsonl file's lines are;
        params: one SamplingParams for all, or a list of them, one per prompt."""
        from flexh2o.requests import Defaults, check_top_k, check_top_p, fit_positions, request_from
        prompts = _prompt_list(prompts)
        a = self.args
        what = "conversation" if chat else "prompt"
        defaults = Defaults(a.gen_len, a.temperature, a.top_p, a.seed, a.top_k)
        out = []
        for i, (p, sp) in enumerate(zip(prompts, _per_prompt(params, len(prompts)))):
            given = {"max_new_tokens": sp.max_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
                     "top_k": sp.top_k, "seed": sp.seed, "stop": list(sp.stop) if sp.stop else None}
            fields = {k: v for k, v in given.items() if v is not None}
            try:
                prompt = {"messages": p} if chat else _prompt_field(p)
                out.append(request_from({"id": str(i), **prompt, **fields}, defaults, self.cfg.vocab,
                                        self.tokenizer, self.cfg.max_positions, self.chat_template if chat else None))
            except ValueError as e:
                raise ValueError(f"{what} {i}: {e}") from None
        try:
            fit_positions(out, self.cfg.max_positions, lambda r: f"{what} {r.id}")
        except ValueError as e:
            raise ValueError(f"{what}s: {e}") from None
        check_top_p(a.top_p, [r.temperature for r in out], "top_p")
        check_top_k(a.top_k, [r.temperature for r in out], "top_k")
        return out


def _prompt_list(prompts) -> list:
    listed = [] if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__") else list(prompts)
    if not listed:
        raise ValueError("prompts: give a non-empty list of prompts (strings or token-id lists)")
    return listed


def _conversations(conversations) -> list:
    """A list of conversations; one conversation alone (a list of message dicts) becomes a list of one."""
    if isinstance(conversations, (list, tuple)) and conversations and all(isinstance(m, dict) for m in conversations):
        return [list(conversations)]
    if not isinstance(conversations, (list, tuple)) or not conversations:
        raise ValueError("conversations: give a list of messages ({\"role\": ..., \"content\": ...}), or a list "
                         "of such lists")
    return list(conversations)


def _per_prompt(params, n: int) -> list:
    """n SamplingParams: params for every prompt (None: the defaults), or a list of them, one per prompt."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"params: give a SamplingParams, or a list of them, one per prompt (not "
                         f"{type(params).__name__})")
    if len(params) != n:
        raise ValueError(f"params: {len(params)} SamplingParams for {n} prompts: give one per prompt, or one for all")
    return list(params)


def _prompt_field(p) -> dict:
    """One prompt as a request line's field: text, or token ids (a list, tuple, 1-D array or tensor)."""
    if isinstance(p, str):
        return {"prompt": p}
    ids = p.tolist() if hasattr(p, "tolist") else p
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"give a string or a list of token ids, not {type(p).__name__} {p!r} (one prompt of "
                         "token ids is [[5, 6, 7]], not [5, 6, 7])")
    return {"prompt_ids": list(ids)}


def serves(kept, rc) -> bool:
    """A kept engine planned for `kept` (a RunConfig) can run `rc`'s requests: the same run in every respect but
    prompt and generation lengths and the GPU batch (the default one follows the number of prompts), and those
    within its plan (so its weights, tiers and cache are rc's; spare rows idle). The tier capacities are measured
    afresh by each call (free disk space moves); the kept engine already holds its memory."""
    if rc.prompt_len > kept.prompt_len or rc.gen_len > kept.gen_len or rc.gpu_batch_size > kept.gpu_batch_size:
        return False
    same = {"prompt_len": rc.prompt_len, "gen_len": rc.gen_len, "gpu_batch_size": rc.gpu_batch_size,
            "gpu_mem": rc.gpu_mem, "cpu_mem": rc.cpu_mem, "disk_mem": rc.disk_mem}
    return kept.with_(**same) == rc


def _model_source(model: str) -> tuple:
    """(converted checkpoint path, tokenizer) of `model` by the one resolver (weights/source.py): smollm2, a .gguf
    file, a Hugging Face folder or a checkpoint folder; (None, None) for a built-in name (seeded dummy weights)."""
    from flexh2o.planning.machine import models_dir
    from flexh2o.weights.source import resolve
    src = resolve(model, models_dir(), what="model")
    return src.path, src.tokenizer


def _budget_warning(kv_budget) -> None:
    """A token budget under the floor is obeyed as given, with one warning (cli/kv_flags.py's, in the API's name)."""
    from flexh2o.cli.kv_flags import budget_warning
    text = budget_warning(kv_budget, "kv_budget")
    if text:
        import warnings
        warnings.warn(text[len("warning: "):], stacklevel=4)


def _model_config(args):
    from flexh2o import config as model_configs
    if args.path != "_DUMMY_":
        return model_configs.load_converted_config(args.path)
    return model_configs.from_name(args.model or "opt-125m")
