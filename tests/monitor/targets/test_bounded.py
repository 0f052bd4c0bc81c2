"""No target can exhaust the monitor: every body, stream and line it reads is bounded while reading.

On main before the limits, a 1 GiB answer took the process to 9.6 GB, an endless SSE stream to
5.0 GB, one endless SSE line to 4.1 GB and a 1 GiB ``/server_info`` to 3.2 GB. Here hostile
servers on loopback (a network seam: no engine sends these on purpose) answer ``kvcanary check``
with each of those, endlessly; the check must finish with an ``error`` naming the limit, within
its timeouts, in the memory of an idle monitor.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support import REPO

CHUNK = 1 << 20
GIB = 1 << 30
SSE_EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n'


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, mode: str) -> None:
    """Read one request's head and body, then send ``mode``'s endless or enormous answer."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0
    )
    await reader.readexactly(length)
    path = head.split(b" ")[1].decode()
    if path.endswith("completions") and mode.startswith("sse"):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
        piece = SSE_EVENT * (CHUNK // len(SSE_EVENT)) if mode == "sse_endless" else b"x" * CHUNK
        if mode == "sse_line":
            writer.write(b"data: ")
    elif (path.endswith("completions") and mode == "huge_json") or (
        path.endswith("server_info") and mode == "huge_info"
    ):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n")
        writer.write(b'{"choices":[{"index":0,"text":"')
        piece = b"y" * CHUNK
    else:
        writer.write(
            b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
        )
        await writer.drain()
        writer.close()
        return
    sent = 0
    while sent < GIB or mode == "sse_endless":
        writer.write(piece)
        await writer.drain()  # raises once the monitor hangs up
        sent += len(piece)
    writer.close()


def serve(mode: str) -> tuple[str, asyncio.AbstractEventLoop]:
    """Start a hostile server for ``mode`` in a thread; return its URL and loop (stop it with the loop)."""
    loop = asyncio.new_event_loop()

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await _answer(r, w, mode)

    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", loop


@pytest.fixture
def hostile() -> Iterator[dict[str, str]]:
    started = {mode: serve(mode) for mode in ("huge_json", "sse_endless", "sse_line", "huge_info")}
    yield {mode: url for mode, (url, _) in started.items()}
    for _, loop in started.values():
        loop.call_soon_threadsafe(loop.stop)


def test_huge_and_endless_answers_are_errors_read_in_bounded_memory(
    tmp_path: Path, hostile: dict[str, str]
) -> None:
    targets = [
        {"name": mode, "base_url": url, "engine": "sglang", "tenants": [{"name": "a"}], "timeout_seconds": 60,
         "probes": ["capacity"] if mode == "huge_info" else ["canary"],
         "options": {"canary": {"stream": mode.startswith("sse")}}}
        for mode, url in hostile.items()
    ]  # fmt: skip
    path = tmp_path / "kvcanary.yml"
    path.write_text(yaml.safe_dump({"api": {"local_only": True}, "targets": targets}))
    # A fresh parent, so that the peak RSS it reports is the check's alone.
    check = f"[sys.executable, '-m', 'monitor', 'check', '--json', '--config', {str(path)!r}]"
    measure = (
        "import resource, subprocess, sys; "
        f"p = subprocess.run({check}, capture_output=True, text=True); "
        "print(p.stdout); print('RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    out = subprocess.run(
        [sys.executable, "-c", measure], capture_output=True, text=True, cwd=REPO, timeout=240
    ).stdout
    rows = {r["target"]: r for r in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}
    peak_mb = int(out.rsplit("RSS_KB", 1)[1]) / 1024
    print(f"\npeak RSS of kvcanary check against four hostile servers: {peak_mb:.0f} MB")
    for mode in ("huge_json", "sse_endless", "sse_line"):
        assert (rows[mode]["verdict"], rows[mode]["reason"]) == ("error", "response_too_large"), rows[mode]
    assert rows["huge_info"]["verdict"] == "error" and "more than" in rows["huge_info"]["detail"]
    assert peak_mb < 300  # an idle monitor process is ~100 MB; the answers were GiB or endless
