"""flexh2o-serve: an OpenAI-compatible HTTP server (flexh2o/serve/) on one engine. Its engine options are
flexh2o-run's (the same parser); --prompt-len and --gen-len are the plan's maxima: the longest prompt and the most
tokens a request may ask for. SIGTERM (or Ctrl-C) stops taking requests, answers those in flight, frees the
engine (its offload files too) and exits 0 (130 for Ctrl-C)."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from typing import Optional

from flexh2o.cli.console import run_main
from flexh2o.cli.request_job import chat_template_of, stop_rule
from flexh2o.cli.run import build_parser as run_parser
from flexh2o.cli.run import build_run_config

NOT_SERVER = ("prompt", "chat", "prompt_file", "output_file", "resume", "dry_run", "no_refill", "cut_gen_len",
              "debug_mode", "stage_layers", "log_file")  # flexh2o-run's flags for jobs from files or one-off runs
MAXIMA = {"--prompt-len": "the longest prompt (in tokens) a request may send: the plan holds it",
          "--gen-len": "the most tokens a request may ask for (max_tokens; a request without one gets this many): "
                       "the plan holds it"}


def build_parser():
    p = run_parser()
    p.prog = "flexh2o-serve"
    p.description = ("An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health, "
                     "/metrics) on the offloading engine; rows take queued requests at each step boundary.")
    for action in p._actions:
        if action.option_strings and action.option_strings[0] in MAXIMA:
            action.help = MAXIMA[action.option_strings[0]]
    a = p.add_argument
    a("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface; then give --api-key)")
    a("--port", type=int, default=8000, help="port to listen on (0: any free one, printed at start)")
    a("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 requests (401 without it)")
    a("--max-queue", type=int, default=256, help="requests that may wait for a row; one more is answered 429")
    a("--served-model-name", default=None, help="the model's name in /v1/models and requests (default: --model, "
      "or the checkpoint folder's name)")
    a("--stats-interval", type=float, default=60.0, help="seconds between the summary lines on stderr (requests, "
      "tokens/s, queue length, rows busy); 0: none")
    return p


def main(argv: Optional[list] = None) -> int:
    return run_main("flexh2o-serve", lambda: serve(prepare(argv)), "interrupted; offload files removed")


def parse(argv: Optional[list]):
    from flexh2o.cli.checks import check_run_flags
    args = build_parser().parse_args(argv)
    defaults = run_parser().parse_args([])
    for name in NOT_SERVER:
        if getattr(args, name) != getattr(defaults, name):
            raise ValueError(f"--{name.replace('_', '-')}: flexh2o-serve takes its requests over HTTP; use "
                             "flexh2o-run for jobs from files")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: give 0..65535")
    if args.max_queue < 1:
        raise ValueError(f"--max-queue {args.max_queue}: give at least 1 (requests that may wait for a row)")
    if args.stats_interval < 0:
        raise ValueError(f"--stats-interval {args.stats_interval}: give seconds >= 0")
    check_run_flags(args)
    return args


def prepare(argv: Optional[list]):
    """Parse and check everything, resolve the model and plan the run: (args, RunConfig, cfg, tokenizer,
    template), before anything is allocated."""
    args = parse(argv)  # first: --help and a flag's error import no torch
    from flexh2o.cli.flexgen_flags import flexgen_options
    from flexh2o.cli.model_source import resolve_source
    from flexh2o.prompts import load_tokenizer
    from flexh2o.storage.offload_dir import sweep
    flexgen_options(args)
    name = args.served_model_name or args.model or os.path.basename(os.path.normpath(args.path))
    sweep(args.offload_dir)
    resolve_source(args, "flexh2o-serve")
    cfg = _model_config(args)
    tokenizer = load_tokenizer(args.tokenizer)
    template = chat_template_of(args, tokenizer)
    rc = build_run_config(args, cfg, None)
    args.served_name = name if name != "_DUMMY_" else cfg.name
    return args, rc, cfg, tokenizer, template


def _model_config(args):
    from flexh2o import config as model_configs
    if args.path != "_DUMMY_":
        return model_configs.load_converted_config(args.path)
    return model_configs.from_name(args.model or "opt-125m")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the engine is built (a busy port is one line, exit 2)."""
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    sock.set_inheritable(True)
    return sock


@contextlib.contextmanager
def opened(prepared):
    """The server of prepare()'s run: its engine built, warmed up and its thread started; freed on leaving."""
    from flexh2o.serve.server import ServeOptions, open_server
    args, rc, cfg, tokenizer, template = prepared
    opts = ServeOptions(args.served_name, args.api_key, args.max_queue, args.stats_interval, not args.no_warmup,
                        args.temperature, args.top_p, args.top_k)
    with open_server(opts, rc, cfg, tokenizer, template, stop_rule(args, cfg, tokenizer, template)) as server:
        yield server


def serve(prepared) -> int:
    """Serve until SIGTERM / Ctrl-C (uvicorn answers the open requests first); everything is freed on the way out."""
    args = prepared[0]
    sock = bind(args.host, args.port)
    got = []

    def note(signum, frame):  # uvicorn handles the signal (drain, then stop) and raises it again after: noted
        got.append(signum)
    try:
        with opened(prepared) as server:
            host, port = sock.getsockname()[:2]
            print(f"flexh2o-serve: {server.state.model_name} on http://{host}:{port}/v1 ({server.rows} rows, "
                  f"prompts up to {server.limits.prompt_len} tokens, answers up to {server.limits.gen_len})",
                  file=sys.stderr, flush=True)
            old = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGINT)}
            try:
                server.run([sock])
            finally:
                for s, h in old.items():
                    signal.signal(s, h)
    finally:
        sock.close()
    print("flexh2o-serve: stopped; every request answered, the engine freed", file=sys.stderr, flush=True)
    return 130 if signal.SIGINT in got else 0


if __name__ == "__main__":
    sys.exit(main())
