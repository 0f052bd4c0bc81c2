"""An attacker's host for the credential tests: an HTTP server on an address no target names
(127.0.0.2: loopback on Linux, like all of 127.0.0.0/8, but not the 127.0.0.1 a target's URLs
write) that records the method, path and headers of every request it receives.

It answers as its handler says, or passes each request on to a real engine (``upstream``) and
streams the engine's answer back: a rogue worker a gateway may list, serving like a sound one while
it reads every header sent to it. Served from a thread of its own, so callers inside an event loop
of their own can reach it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

ROGUE_HOST = "127.0.0.2"
#: The server's own errors: sglang-router tries HTTP/2 on a worker first (a preface aiohttp refuses
#: to parse) before it speaks HTTP/1.1, and each try would print a traceback.
_QUIET = logging.getLogger("tests.recording_host")
_QUIET.setLevel(logging.CRITICAL)
_HOP = {"host", "content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}


@dataclass(frozen=True)
class Seen:
    """One request as it arrived: method, path and every header (names lower-cased)."""

    method: str
    path: str
    headers: dict[str, str]

    @property
    def authorization(self) -> str | None:
        return self.headers.get("authorization")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RecordingHost:
    """A server at :attr:`url` on ``host`` that records each request in :attr:`seen` and answers by
    ``handler`` or by passing it on to ``upstream``; :meth:`close` stops it."""

    def __init__(
        self,
        *,
        host: str = ROGUE_HOST,
        handler: Handler | None = None,
        upstream: str | None = None,
        port: int = 0,
    ):
        assert (handler is None) != (upstream is None), "answer by a handler or an upstream"
        self.seen: list[Seen] = []
        self._handler = handler
        self._upstream = upstream
        self._host = host
        self._port = port
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError(f"the recording host on {host} did not start")

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._serve)
        self._runner = web.AppRunner(app, access_log=None, logger=_QUIET)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, self._host, self._port)
        self._loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{self._host}:{port}"
        self._session: aiohttp.ClientSession | None = None
        ready.set()
        self._loop.run_forever()

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        headers = {name.lower(): value for name, value in request.headers.items()}
        self.seen.append(Seen(request.method, request.path, headers))
        if self._handler is not None:
            return await self._handler(request)
        return await self._pass_on(request)

    async def _pass_on(self, request: web.Request) -> web.StreamResponse:
        """Send the request to the upstream engine as it came and stream its answer back."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with self._session.request(
            request.method,
            f"{self._upstream}{request.path_qs}",
            headers=headers,
            data=await request.read(),
            allow_redirects=False,
        ) as answer:
            response = web.StreamResponse(
                status=answer.status,
                headers={k: v for k, v in answer.headers.items() if k.lower() not in _HOP},
            )
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    def requests(self, path: str | None = None) -> list[Seen]:
        """Return the requests seen so far (to ``path`` only, when given)."""
        return [seen for seen in list(self.seen) if path is None or seen.path == path]

    def close(self) -> None:
        async def stop() -> None:
            if self._session is not None:
                await self._session.close()
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


async def refuse_without_key(request: web.Request) -> web.Response:
    """Answer as an engine that takes keys: health without one, anything else 401 without one (and,
    with one, whatever key it is: an attacker's host takes every key it is given)."""
    if request.path == "/health":
        return web.json_response({"status": "ok"})
    if "authorization" not in {name.lower() for name in request.headers}:
        error = {"message": "Missing API key", "type": "authentication_error", "code": "invalid_api_key"}
        return web.json_response({"error": error}, status=401)
    return web.json_response({"object": "list", "data": [{"id": "kvcanary-reference"}]})
