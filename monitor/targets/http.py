"""The HTTP client every target shares: one aiohttp session, one connection pool, one TLS context.

aiohttp, not httpx, for the probes' own traffic: a streamed completion costs ~0.18 ms of monitor
CPU against ~1.2 ms with httpx (measured here, one core, same stub), and a canary run is two of
them: at thousands of targets the HTTP client was most of the monitor's CPU. The session keeps no
cookies: a cookie one tenant's answer set must never ride on another tenant's request (or another
target's on the same host). It is created inside the event loop, on first use.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp

#: Errors that mean no connection could be made at all (refused, unreachable, unresolvable).
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ClientConnectorCertificateError)
#: Errors that mean a connection was made (or taken from the pool) and closed under the request.
#: (``ClientConnectorError`` is a ``ClientOSError`` too, but no connection was made: callers test
#: for ``CONNECT_ERRORS`` first.)
UNHEARD_ERRORS = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
#: How long an idle pooled connection is kept for reuse. Engines served by uvicorn close theirs after
#: 5 s (its default, and SGLang's, vLLM's and the reference worker's); aiohttp keeps them 15 s. A
#: probe sent on one between the two races the server's close and reads "Server disconnected": a
#: probe error on a sound engine (the likely cause of one in the demo under load). Letting go first
#: leaves no race.
IDLE_KEEPALIVE_SECONDS = 2.0


class HttpClient:
    """A lazily created aiohttp session; ``max_connections`` bounds the pool across every target."""

    def __init__(self, max_connections: int = 256):
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()

    async def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            async with self._lock:
                if self._session is None or self._session.closed:
                    connector = aiohttp.TCPConnector(
                        limit=self.max_connections,
                        ttl_dns_cache=300,
                        keepalive_timeout=IDLE_KEEPALIVE_SECONDS,
                    )
                    self._session = aiohttp.ClientSession(
                        connector=connector,
                        # Every caller bounds its whole exchange with asyncio.timeout(); aiohttp's
                        # own default (300 s) would only add a timer per request (~10% of its CPU).
                        timeout=aiohttp.ClientTimeout(total=None),
                        cookie_jar=aiohttp.DummyCookieJar(),
                        # The monitor's own agent, not the library's: engines may log it.
                        headers={"User-Agent": "kvcanary"},
                        auto_decompress=True,
                    )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()


async def chunks(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """Yield the body as it arrives (after decompression, so limits bound what is kept in memory)."""
    async for chunk in response.content.iter_any():
        yield chunk
