"""Run one generation for an HTTP handler: submit to the engine, then answer plain or as SSE.

The handler waits for the engine's FIRST event before it commits to a response. So an error found
before any token (an ownership violation at the first decode step, or an engine failure) is a plain
JSON error with its status, even for ``stream: true``, and no content is ever sent with it. An error
after tokens were streamed (not produced by this worker's checks, which run before the first token,
but possible in principle) ends the stream with a ``data: {"error": ...}`` event and ``data: [DONE]``.
A client that goes away aborts its request, which frees its pages: a stream notices at its next
write, a plain answer by watching for the client's disconnect while the engine works.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvcanary.workers.admission import AdmissionRejected
from kvcanary.workers.engine import Engine
from kvcanary.workers.errors import WorkerError
from kvcanary.workers.protocol import GenerationRequest, ResponseShape, Usage
from kvcanary.workers.request import ErrorEvent, Event, FinishEvent, Request, TokenEvent
from kvcanary.workers.tokenizer import StreamDecoder, decode

T = TypeVar("T")

#: How often a plain answer's handler looks whether its client is still there.
DISCONNECT_POLL_SECONDS = 0.01


class EventChannel:
    """Carry events from the engine thread into the handler's event loop."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()

    def emit(self, event: Event) -> None:
        """Hand ``event`` over from any thread."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def next(self) -> Event:
        """Return the next event, waiting for it."""
        return await self._queue.get()


class ClosingStream(StreamingResponse):
    """A stream whose events are closed the moment the response ends, however it ends.

    A client that hangs up makes the server's ``send`` raise outside the event generator, which is
    left waiting at its ``yield``; its ``finally`` (the engine's abort) would run only once the
    generator is garbage-collected, and the engine would decode on for nobody until then.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


def _usage(event: FinishEvent) -> Usage:
    return Usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens)


def error_of(event: ErrorEvent) -> WorkerError:
    return WorkerError(event.status, event.message, type=event.type, code=event.code)


async def generate(
    engine: Engine,
    shape: ResponseShape,
    prompt_ids: list[int],
    body: GenerationRequest,
    *,
    tenant: str,
    client_id: str | None = None,
    http: HttpRequest | None = None,
    adapter: str | None = None,
) -> Response:
    """Return the response for ``prompt_ids``; raise ``WorkerError`` for a rejection or an early failure."""
    channel = EventChannel()
    try:
        request = engine.submit(
            prompt_ids,
            body.token_budget(),
            tenant=tenant,
            emit=channel.emit,
            cache_salt=body.cache_salt,
            adapter=adapter,
            client_id=body.rid or client_id or body.user,  # the client's id for it, if it gave one
            sampling=body.sampling(),
        )
    except AdmissionRejected as rejected:
        raise rejection_error(rejected) from None
    return await respond(engine, request, channel, shape, body, http)


def rejection_error(rejected: AdmissionRejected) -> WorkerError:
    """Return the HTTP 400 of an admission refusal (SGLang's wording is in the message)."""
    return WorkerError(400, rejected.message, type="BadRequestError", code=400)


async def respond(
    engine: Engine,
    request: Request,
    channel: EventChannel,
    shape: ResponseShape,
    body: GenerationRequest,
    http: HttpRequest | None,
) -> Response:
    """Return the response of a queued ``request`` whose events arrive on ``channel``, plain or
    streamed; raise ``WorkerError`` for an error before its first token."""
    try:
        first = await channel.next()
        if isinstance(first, ErrorEvent):
            raise error_of(first)
        if body.stream:
            events = _sse(engine, request, shape, channel, first, include_usage=body.include_usage)
            return ClosingStream(events, media_type="text/event-stream")
        answer = await unless_gone(http, _collect(shape, channel, first))
        if answer is None:  # nobody to answer; 499 as nginx logs a client that closed its request
            engine.abort(request)
            return Response(status_code=499)
        return JSONResponse(answer)
    except BaseException:
        engine.abort(request)
        raise


async def unless_gone(http: HttpRequest | None, answer: Coroutine[Any, Any, T]) -> T | None:
    """Return ``answer``'s result, or None as soon as the client disconnects before it is ready.

    Starlette cancels nothing when the client of a plain answer leaves, so the engine would decode
    the whole answer for nobody (vLLM watches the same way: ``with_cancellation``).
    """
    work = asyncio.ensure_future(answer)
    if http is None:
        return await work
    watch = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            return None
        return work.result()
    finally:
        watch.cancel()


async def _disconnected(http: HttpRequest) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)


async def _collect(shape: ResponseShape, channel: EventChannel, event: Event) -> dict[str, Any]:
    tokens: list[int] = []
    while True:
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
        elif isinstance(event, FinishEvent):
            usage = _usage(event)
            return shape.complete(decode(tokens), event.reason, usage)
        else:
            raise error_of(event)
        event = await channel.next()


def _data(body: dict[str, Any] | str) -> str:
    payload = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {payload}\n\n"


async def _sse(
    engine: Engine,
    request: Request,
    shape: ResponseShape,
    channel: EventChannel,
    event: Event,
    *,
    include_usage: bool,
) -> AsyncIterator[str]:
    """Yield the SSE events of a stream whose first engine event is ``event``."""
    decoder = StreamDecoder()
    finished = False
    try:
        if shape.kind == "chat":
            yield _data(shape.chunk("", first=True, with_usage=include_usage))
        while True:
            if isinstance(event, TokenEvent):
                text = decoder.push(event.token_id)
                if text:
                    yield _data(shape.chunk(text, with_usage=include_usage))
            elif isinstance(event, FinishEvent):
                tail = decoder.flush()
                yield _data(shape.chunk(tail or None, event.reason, with_usage=include_usage))
                if include_usage:
                    yield _data(shape.usage_chunk(_usage(event)))
                break
            else:
                yield _data(error_of(event).body())
                break
            event = await channel.next()
        finished = True
        yield _data("[DONE]")
    finally:
        if not finished:
            engine.abort(request)
