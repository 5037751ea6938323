"""The ASGI app (FastAPI): routes only. A /v1 request is checked (schemas.py), queued (live.py) and answered from
the engine thread's events (stream.py), whole or as server-sent events; the engine runs elsewhere (worker.py)."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import sys
from dataclasses import dataclass
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from flexh2o.serve import schemas
from flexh2o.serve.answer import answer_stream, answer_whole
from flexh2o.serve.live import LiveQueue
from flexh2o.serve.responses import Shape
from flexh2o.serve.schemas import ApiError, Limits
from flexh2o.serve.stats import ServeStats
from flexh2o.serve.stream import Answer


@dataclass
class ServerState:
    """What the routes read: the queue and counters, the model's facts and the server's options."""

    worker: object  # worker.EngineWorker
    queue: LiveQueue
    stats: ServeStats
    limits: Limits
    tokenizer: object
    template: object  # chat.ChatTemplate or None
    chat_stops: tuple  # the template's end-of-turn strings that are no single token (stops of every chat answer)
    model_name: str
    api_key: Optional[str] = None
    stats_interval: float = 60.0


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(lifespan=_lifespan(state), openapi_url=None, docs_url=None, redoc_url=None)
    app.state.serve = state

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        state.stats.refuse(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        code = "unknown_url" if e.status_code == 404 else None
        msg = (f"Unknown request URL: {request.method} {request.url.path}" if e.status_code == 404
               else f"{request.method} {request.url.path}: {e.detail}")
        return await api_error(request, ApiError(e.status_code, msg, code=code))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.stats.prometheus(len(state.queue)), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        _authorize(state, request)
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str):
        _authorize(state, request)
        _check_model(state, model)
        return _model_card(state)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _answer(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _answer(state, request, chat=True)
    return app


def _authorize(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
        raise ApiError(401, "missing or wrong API key: send the server's --api-key as 'Authorization: Bearer KEY'",
                       code="invalid_api_key")


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "flexh2o"}


def _check_model(state: ServerState, model) -> None:
    if model != state.model_name:
        raise ApiError(404, f"The model {model!r} does not exist: this server serves {state.model_name!r}",
                       "model", "model_not_found")


async def _answer(state: ServerState, request: Request, chat: bool):
    _authorize(state, request)
    try:
        body = await request.json()
    except ValueError:
        raise schemas.bad("the request body is not valid JSON") from None
    schemas.check_fields(body, chat)
    if "model" not in body:
        raise schemas.bad("model: missing (GET /v1/models lists it)", "model")
    _check_model(state, body["model"])
    parsed = schemas.make_requests(body, chat, state.limits, state.tokenizer, state.template, state.chat_stops)
    ans = Answer(parsed.requests)
    if not state.queue.put(ans.live):
        raise ApiError(429, f"the server's queue is full ({state.queue.max_queue} requests wait, its --max-queue): "
                       "retry later", code="rate_limit_exceeded", kind="rate_limit_error")
    shape = Shape(chat, state.model_name)
    prompt_tokens = sum(len(r.prompt_ids) for r in parsed.requests[::parsed.n])
    if parsed.stream:
        return StreamingResponse(answer_stream(ans, parsed, shape, state.tokenizer, prompt_tokens),
                                 media_type="text/event-stream")
    return await answer_whole(request, ans, parsed, shape, prompt_tokens)


def _lifespan(state: ServerState):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(_summaries(state)) if state.stats_interval > 0 else None
        try:
            yield
        finally:  # uvicorn has answered every open request by now: the engine thread finishes and stops
            if task is not None:
                task.cancel()
            await asyncio.to_thread(state.worker.stop)
    return lifespan


async def _summaries(state: ServerState) -> None:
    while True:
        await asyncio.sleep(state.stats_interval)
        print(state.stats.summary(len(state.queue)), file=sys.stderr, flush=True)
