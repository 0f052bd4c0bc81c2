"""A request the server closed before answering a byte is sent once more; one it began to answer is not.

A loaded monitor can take a pooled connection the engine has just let go of (its loop sees the idle
spell late): the engine never read the request, and without a second send a sound engine's probe
reads "Server disconnected". The servers here are raw asyncio sockets, so each scene is exactly
what the engine did on the wire, and they count the requests they read.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes.target import Completion, CompletionRequest

ANSWER = json.dumps({"choices": [{"message": {"content": "OK"}, "finish_reason": "stop"}]}).encode()
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
OK = HEAD % len(ANSWER) + ANSWER
#: Headers promising a body that never comes: the engine had begun to answer.
CUT = HEAD % 500 + b"{"

#: How a server treats the ``n``-th request (from 1) read on the ``c``-th connection (from 1):
#: the bytes to answer with (anything but OK closes the connection after it), or None to close
#: the connection unanswered.
Answer = Callable[[int, int], bytes | None]


async def read_request(reader: asyncio.StreamReader) -> bool:
    """Read one request (headers and a Content-Length body); False when the client closed."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return False
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    await reader.readexactly(length)
    return True


async def complete_twice(answer: Answer) -> tuple[list[Completion], int]:
    """Two completions through one target, 0.1 s apart: what came back and how many requests the
    server read."""
    requests = connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests, connections
        connections += 1
        connection, served = connections, 0
        while await read_request(reader):
            requests += 1
            served += 1
            reply = answer(connection, served)
            if reply is not None:
                writer.write(reply)
                await writer.drain()
            if reply != OK:  # unanswered, or cut short: the connection closes
                break
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    config = TargetConfig(
        name="t1",
        base_url=f"http://127.0.0.1:{port}",
        tenants=[{"name": "alice"}],
        probes=["canary"],
        timeout_seconds=5,
    )
    completions = []
    async with OpenAIHttpTarget(config, {"alice": None}) as target:
        for _ in range(2):
            completions.append(await target.complete("alice", CompletionRequest("hi", stream=False)))
            await asyncio.sleep(0.1)
    server.close()
    return completions, requests


def run(scene: Callable[[], Awaitable[tuple[list[Completion], int]]]) -> tuple[list[Completion], int]:
    return asyncio.run(asyncio.wait_for(scene(), 30))


def test_a_pooled_connection_closed_as_the_next_request_went_out_is_sent_once_more() -> None:
    def answer(connection: int, served: int) -> bytes | None:
        return None if (connection, served) == (1, 2) else OK  # the first connection dies under request 2

    completions, requests = run(lambda: complete_twice(answer))
    assert [(c.status, c.error_kind, c.text) for c in completions] == [(200, None, "OK")] * 2
    assert requests == 3  # the one closed unanswered, and its second send


def test_an_engine_that_closes_every_request_unanswered_is_an_error_after_one_second_send() -> None:
    completions, requests = run(lambda: complete_twice(lambda connection, served: None))
    assert [(c.status, c.error_kind) for c in completions] == [(None, "protocol")] * 2
    assert all("ServerDisconnected" in (c.error or "") for c in completions)
    assert requests == 4  # each sent twice, never more


def test_an_answer_cut_after_its_headers_is_not_sent_again() -> None:
    completions, requests = run(lambda: complete_twice(lambda connection, served: CUT))
    assert [(c.status, c.error_kind) for c in completions] == [(200, "protocol")] * 2
    assert requests == 2  # the engine answered something: a second send could judge another request
