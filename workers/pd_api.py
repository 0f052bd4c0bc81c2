"""Answering a completion as a prefill server or a decode server behind SGLang's model gateway.

The gateway sends the client's body to one prefill and one decode server at once, each with
``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``; the client gets the decode server's
answer once the prefill server has answered (a prefill 400 is the client's 400, a 5xx on either
side is retried with a new room). So:

- the prefill server plans admission (400 on a refusal, the placeholder under the defect), computes
  the prompt, waits for the decode server to take the room's K/V and answers a small 200 whose usage
  counts the tokens it computed;
- the decode server plans the same prompt, fetches the room's K/V (a 500 when the prefill server
  cannot be reached or does not deliver in ``--kv-transfer-timeout`` seconds, as SGLang's bootstrap
  failure) and answers as the in-process engine does, plain or streamed. Its answer carries
  ``X-KVCanary-KV-Transfer-Seconds``, the time the hand-off took, which the gateway passes on. With
  ``--kv-checksum`` it first digests the rows it received: a digest other than the prefill server's
  fails the request with HTTP 500 (``kv_checksum_mismatch``) before anything is decoded, counted in
  ``kvcanary_kv_transfer_checksum_failures_total`` and, as SGLang counts it among its transfer
  failures, in ``kvcanary_kv_transfer_failures_total{side="decode"}``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from kvcanary.workers.admission import AdmissionRejected
from kvcanary.workers.engine import Engine
from kvcanary.workers.errors import WorkerError
from kvcanary.workers.generation import (
    EventChannel,
    error_of,
    generate,
    rejection_error,
    respond,
    unless_gone,
)
from kvcanary.workers.pd_serving import CLIENT_GONE, DecodeEngine, PrefillEngine
from kvcanary.workers.pd_transfer import HandoffFailed, KVHandoff, abandon_room, fetch_kv, kv_digest
from kvcanary.workers.protocol import GenerationRequest, ResponseShape, Usage
from kvcanary.workers.request import ErrorEvent, FinishEvent

log = logging.getLogger("kvcanary.workers.pd_api")
TRANSFER_SECONDS_HEADER = "X-KVCanary-KV-Transfer-Seconds"
#: How long a decode server tries to tell a prefill server that it refused a room (a local hop).
ABANDON_TIMEOUT_SECONDS = 1.0


async def serve_generation(
    engine: Engine,
    shape: ResponseShape,
    prompt_ids: list[int],
    body: GenerationRequest,
    *,
    tenant: str,
    client_id: str | None,
    http: HttpRequest,
    adapter: str | None,
) -> Response:
    """Answer a completion as this worker's mode does: prefill server, decode server, or whole."""
    fields: dict[str, object] = {"tenant": tenant, "cache_salt": body.cache_salt, "adapter": adapter}
    client = body.rid or client_id or body.user
    if isinstance(engine, PrefillEngine):
        return await _prefill(engine, shape, prompt_ids, body, http, client_id=client, **fields)
    if isinstance(engine, DecodeEngine):
        fields["sampling"] = body.sampling()
        return await _decode(engine, shape, prompt_ids, body, http, client_id=client, **fields)
    return await generate(
        engine, shape, prompt_ids, body, tenant=tenant, client_id=client_id, http=http, adapter=adapter
    )


def _bootstrap(body: GenerationRequest) -> tuple[str, int, int]:
    """Return the body's ``(bootstrap_host, bootstrap_port, bootstrap_room)``; 400 when one is missing."""
    host, port, room = body.bootstrap_host, body.bootstrap_port, body.bootstrap_room
    if host is None or port is None or room is None:
        raise WorkerError(
            400,
            "A prefill or decode server needs bootstrap_host, bootstrap_port and bootstrap_room in the "
            "body (SGLang's model gateway adds them); send requests through the gateway.",
            param="bootstrap_room",
        )
    return host, port, room


async def _prefill(
    engine: PrefillEngine,
    shape: ResponseShape,
    prompt_ids: list[int],
    body: GenerationRequest,
    http: HttpRequest,
    **fields: object,
) -> Response:
    """Compute the room's prompt and answer once the decode server has its K/V; a client that
    leaves first (a gateway whose decode leg failed) aborts it, freeing the room's pages."""
    _, _, room = _bootstrap(body)
    channel = EventChannel()
    try:
        request = engine.submit_room(room, prompt_ids, body.token_budget(), emit=channel.emit, **fields)
    except AdmissionRejected as rejected:
        raise rejection_error(rejected) from None
    try:
        # The finish once the decode server took the K/V, or an error; None once the client left.
        event = await unless_gone(http, channel.next())
    except BaseException:
        engine.abort(request)
        raise
    if event is None:
        engine.abort(request)
        return Response(status_code=CLIENT_GONE)
    if isinstance(event, ErrorEvent):
        raise error_of(event)
    cached = event.cached_tokens if isinstance(event, FinishEvent) else None
    usage = Usage(request.plan.prompt_tokens, 0, cached)
    return JSONResponse(shape.complete("", "stop", usage))


def _fetch(engine: DecodeEngine, host: str, port: int, room: int) -> tuple[KVHandoff, int | None]:
    """Fetch the room's K/V (raises ``HandoffFailed``) and, with ``--kv-checksum`` and a digest sent,
    digest what came (None: nothing to check)."""
    handoff = fetch_kv(host, port, room, engine.config.kv_transfer_timeout)
    if not engine.config.kv_checksum or handoff.checksum is None:
        return handoff, None
    return handoff, kv_digest(handoff.k, handoff.v)


async def _decode(
    engine: DecodeEngine,
    shape: ResponseShape,
    prompt_ids: list[int],
    body: GenerationRequest,
    http: HttpRequest,
    **fields: object,
) -> Response:
    """Plan the prompt, fetch the room's K/V from the prefill server and decode."""
    host, port, room = _bootstrap(body)
    try:
        plan = engine.plan(prompt_ids, body.token_budget())
    except AdmissionRejected as rejected:
        error = rejection_error(rejected)
        # The prefill server would hold the room's pages until it expires; tell it now.
        await asyncio.to_thread(abandon_room, host, port, room, error.status, ABANDON_TIMEOUT_SECONDS)
        raise error from None
    started = time.monotonic()
    try:
        handoff, digest = await asyncio.to_thread(_fetch, engine, host, port, room)
    except HandoffFailed as failed:
        if failed.status >= 500:
            engine.metrics.kv_transfer_failures.labels(side="decode").inc()
        raise WorkerError(
            failed.status, failed.message, type="kv_transfer_failed", code=failed.status
        ) from None
    if digest is not None and digest != handoff.checksum:
        engine.metrics.kv_transfer_checksum_failures.inc()
        engine.metrics.kv_transfer_failures.labels(side="decode").inc()
        message = (
            f"KV checksum mismatch for room {room}: the prefill server sent {handoff.checksum:#010x}, "
            f"the rows received digest to {digest:#010x}"
        )
        log.error(message)
        raise WorkerError(500, message, type="kv_checksum_mismatch", code=500)
    took = time.monotonic() - started
    channel = EventChannel()
    try:
        request = engine.enqueue_received(plan, handoff, emit=channel.emit, **fields)
    except ValueError as mismatch:
        raise WorkerError(500, str(mismatch), type="kv_transfer_failed", code=500) from None
    response = await respond(engine, request, channel, shape, body, http)
    response.headers[TRANSFER_SECONDS_HEADER] = f"{took:.6f}"
    return response
