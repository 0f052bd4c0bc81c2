"""``monitor/targets/http.py``: the one HTTP client every target shares.

Its pool must let go of an idle connection before an engine does: uvicorn (SGLang, vLLM, the
reference worker) closes one idle for 5 s, and a probe sent on it just then reads "Server
disconnected", a probe error on a sound engine. The server here keeps every connection open and
counts them, so what is measured is the client's own choice: reuse while warm, a new connection
after an idle spell longer than ``IDLE_KEEPALIVE_SECONDS`` (and shorter than uvicorn's 5 s).
"""

from __future__ import annotations

import asyncio

from kvcanary.monitor.targets.http import IDLE_KEEPALIVE_SECONDS, HttpClient

UVICORN_KEEPALIVE_SECONDS = 5.0
ANSWER = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok"
)


async def requests_and_connections(pause: float) -> int:
    """Two requests ``pause`` seconds apart through one client: how many connections the server saw."""
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while await reader.readuntil(b"\r\n\r\n"):  # a GET has no body; closed by the client: IncompleteRead
            writer.write(ANSWER)
            await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = HttpClient()
    try:
        session = await client.session()
        for i in range(2):
            if i:
                await asyncio.sleep(pause)
            async with session.get(f"http://127.0.0.1:{port}/health") as answer:
                assert answer.status == 200 and await answer.read() == b"ok"
        return connections
    finally:
        await client.aclose()
        server.close()


def test_a_warm_connection_is_reused() -> None:
    assert asyncio.run(requests_and_connections(0.1)) == 1


def test_an_idle_connection_is_let_go_before_uvicorn_would_close_it() -> None:
    assert IDLE_KEEPALIVE_SECONDS < UVICORN_KEEPALIVE_SECONDS - 1  # a second's slack for a loaded host
    assert asyncio.run(requests_and_connections(IDLE_KEEPALIVE_SECONDS + 1.0)) == 2
