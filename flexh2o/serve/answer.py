"""An answer sent back: whole (one JSON object once every choice has ended) or streamed (a server-sent event per
piece of text, the end of each choice, the usage when asked, then [DONE]). Either way, a client that goes away
cancels its requests: their rows are freed at the engine's next step boundary."""
from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from flexh2o.batch.openai_format import FINISH, chat_completion_object, completion_object
from flexh2o.serve.responses import DONE, Shape, sse, usage
from flexh2o.serve.schemas import ApiError, Parsed
from flexh2o.serve.stream import Answer, TextDeltas

ENGINE_FAILED = ApiError(500, "the engine failed while answering (see the server's log)", kind="server_error")


def _ended(end):
    """The Result of a choice's end event; an engine failure (or a cancel the client did not ask) is an error."""
    if end is None or isinstance(end, Exception):
        raise ENGINE_FAILED
    return end


async def answer_whole(request: Request, ans: Answer, parsed: Parsed, shape: Shape, prompt_tokens: int):
    """The whole answer, or nothing when the client goes away first (its requests cancelled)."""
    results = [None] * len(parsed.requests)

    async def collect():
        async for event in ans.events():
            if event.is_end:
                results[event.index] = event.end
    work, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():  # the client went away (or the server's task was cancelled)
            work.cancel()
            ans.cancel()
    if not work.done() or work.cancelled():
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    try:
        done = [_ended(r) for r in results]
    except ApiError as e:
        return JSONResponse(e.body(), status_code=e.status)
    return (chat_completion_object if shape.chat else completion_object)(shape.model, done, prompt_tokens)


async def _disconnect(request: Request) -> None:
    """Returns once the client has gone away (the ASGI server's http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def answer_stream(ans: Answer, parsed: Parsed, shape: Shape, tokenizer, prompt_tokens: int):
    """Server-sent events; the ASGI server cancels this generator when the client goes away."""
    n = len(parsed.requests)
    deltas = [TextDeltas(tokenizer, parsed.stops) for _ in range(n)]
    generated = 0
    try:
        if shape.chat:  # OpenAI's first chunk of a choice names the role
            for i in range(n):
                yield shape.chunk(shape.choice(i, "", None, first=True), parsed.include_usage)
        async for event in ans.events():
            i = event.index
            if not event.is_end:
                piece = deltas[i].add(event.token)
                if piece:
                    yield shape.chunk(shape.choice(i, piece, None), parsed.include_usage)
                continue
            try:
                result = _ended(event.end)
            except ApiError as e:
                yield sse(e.body())
                return
            generated += result.generated_tokens
            yield shape.chunk(shape.choice(i, deltas[i].end(result.text), FINISH[result.finish_reason]),
                              parsed.include_usage)
        if parsed.include_usage:
            yield shape.usage_chunk(usage(prompt_tokens, generated))
        yield DONE
    finally:
        ans.cancel()  # a no-op once every choice has ended
