"""The server's parts put together: the engine (its weights loaded once), the engine thread, the queue, the app;
`run` serves on given sockets with uvicorn until a signal (or `should_exit`), and leaving the block frees it all."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

from flexh2o.batch.stopping import StopRule
from flexh2o.engine import Engine
from flexh2o.job import warm_up
from flexh2o.requests import Defaults
from flexh2o.serve.app import ServerState, build_app
from flexh2o.serve.live import LiveQueue
from flexh2o.serve.schemas import Limits
from flexh2o.serve.stats import ServeStats
from flexh2o.serve.worker import EngineWorker


@dataclass(frozen=True)
class ServeOptions:
    model_name: str
    api_key: Optional[str] = None
    max_queue: int = 256
    stats_interval: float = 60.0
    warmup: bool = True
    temperature: float = 0.0  # for requests that give none (flexh2o-run's --temperature / --top-p / --top-k)
    top_p: float = 1.0
    top_k: int = 0


class Server:
    def __init__(self, state: ServerState, rows: int):
        self.state, self.rows, self.limits = state, rows, state.limits
        self.app = build_app(state)

    def uvicorn(self, log_level: str = "warning"):
        import uvicorn
        config = uvicorn.Config(self.app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=None,
                                access_log=False)
        return uvicorn.Server(config)

    def run(self, sockets: list) -> None:
        self.uvicorn().run(sockets=sockets)


def chat_stops(template, tokenizer) -> tuple:
    """The template's end-of-turn strings that are no single token (the single ones join the EOS ids)."""
    if template is None:
        return ()
    if tokenizer is None:
        return template.stop_strings
    return tuple(s for s in template.stop_strings if len(tokenizer.encode(s, bos=False)) != 1)


@contextlib.contextmanager
def open_server(opts: ServeOptions, rc, cfg, tokenizer, template, rule: StopRule):
    """template: the model's ChatTemplate (None: no chat); rule: the run's stopping rule (cli/request_job.py's)."""
    queue, stats = LiveQueue(opts.max_queue), ServeStats(rc.num_seqs)
    limits = Limits(rc.prompt_len, rc.gen_len, cfg.max_positions, cfg.vocab,
                    Defaults(rc.gen_len, opts.temperature, opts.top_p, rc.seed, opts.top_k))
    with Engine(rc) as eng:
        if opts.warmup:
            warm_up(eng, [list(range(1, 9))], rc.num_seqs)
        worker = EngineWorker(eng, queue, rule, stats)
        state = ServerState(worker, queue, stats, limits, tokenizer, template, chat_stops(template, tokenizer),
                            opts.model_name, opts.api_key, opts.stats_interval)
        worker.start()
        try:
            yield Server(state, rc.num_seqs)
        finally:
            worker.stop()
