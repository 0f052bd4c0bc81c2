"""Serve a scripted engine on a real loopback socket, for tests that need answers no engine gives.

A handler takes an ``httpx.Request`` and returns an ``httpx.Response`` (or awaits one), the shape
``httpx.MockTransport`` uses; :class:`Loopback` puts it behind an HTTP server on 127.0.0.1 in a
thread of its own, so the monitor's real client (aiohttp, its pool, its limits) reads the answer
from a socket like any engine's.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Awaitable, Callable

import httpx
from aiohttp import web

Handler = Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]]
_HOP = {"content-length", "transfer-encoding", "connection"}


class ServedApp:
    """An aiohttp application served at :attr:`url` (127.0.0.1, a free port) from a thread of its
    own until :meth:`close`, so that callers inside an event loop of their own can reach it."""

    def __init__(self, app: web.Application):
        self._app = app
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the loopback server did not start")

    def _run(self, ready: threading.Event) -> None:
        # The server's loop lives in this thread only: callers may be inside a loop of their own.
        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(self._app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class Loopback(ServedApp):
    """``handler`` served at :attr:`url` until :meth:`close` (or the end of the test process)."""

    def __init__(self, handler: Handler):
        self.handler = handler
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._serve)
        super().__init__(app)

    async def _serve(self, request: web.Request) -> web.Response:
        body = await request.read()
        asked = httpx.Request(request.method, str(request.url), headers=dict(request.headers), content=body)
        answer = self.handler(asked)
        if inspect.isawaitable(answer):
            answer = await answer
        assert isinstance(answer, httpx.Response)
        headers = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP}
        return web.Response(status=answer.status_code, body=answer.content, headers=headers)
