"""A fast engine stub for load benchmarks: answers the monitor's probes correctly at thousands of req/s.

Not an engine: it echoes what a healthy engine would (the canary's nonce, the plants' text, a
refusal for a prompt over its pool) with the least work possible, so that the monitor, not the
target, is what a benchmark measures. HTTP/1.1 with keep-alive on asyncio's low-level protocol API.

    python bench/stub_engine.py PORT [--pool-tokens 4096] [--noise] [--delay SECONDS]

``--noise`` adds benign variation a real engine shows (a prefix before the answer, quotes, jitter
of a few ms, one 503 in fifty): a soak against it must never produce a leak or a mismatch.
``--delay`` holds every answer that long: a slow engine (5), or one that hangs (3600).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re

MARKER = re.compile(rb"KVC-[0-9a-f]{8}-[0-9a-f]{32}")


class Engine:
    def __init__(self, pool_tokens: int, noise: bool, delay: float = 0.0):
        self.pool = pool_tokens
        self.noise = noise
        self.delay = delay
        self.info = json.dumps(
            {
                "context_length": 8192,
                "max_total_num_tokens": pool_tokens,
                "max_req_input_len": pool_tokens - 1,
                "page_size": 16,
                "disaggregation_mode": "null",
                "version": "stub 1",
                "status": "ready",
            }
        ).encode()

    def answer(self, method: bytes, path: bytes, body: bytes) -> tuple[int, bytes, bytes]:
        """Return (status, content type, body) for one request."""
        if path in (b"/server_info", b"/get_server_info"):
            return 200, b"application/json", self.info
        if path == b"/tokenize":
            return 200, b"application/json", b'{"count": %d}' % len(_prompt(json.loads(body)))
        if not path.endswith(b"completions"):
            return (
                404,
                b"application/json",
                b'{"error": {"message": "Not Found", "type": "NotFound", "code": 404}}',
            )
        if self.noise and random.random() < 0.02:
            return (
                503,
                b"application/json",
                b'{"error": {"message": "overloaded", "type": "Unavailable", "code": 503}}',
            )
        request = json.loads(body)
        prompt = _prompt(request)
        if len(prompt) > self.pool:
            message = b"Input length (%d tokens) exceeds the maximum allowed length (%d tokens)." % (
                len(prompt),
                self.pool - 1,
            )
            return (
                400,
                b"application/json",
                b'{"error": {"message": "%s", "type": "BadRequestError", "code": 400}}' % message,
            )
        found = MARKER.search(prompt)
        text = found.group(0).decode() if found else "OK"
        if self.noise:
            text = (
                random.choice(["", "Sure: ", 'Here it is: "', "`"])
                + text
                + random.choice(["", '"', "`", "."])
            )
        return _reply(request, text, len(prompt))


def _prompt(data: dict) -> bytes:
    if "messages" in data:
        return "".join(m.get("content", "") for m in data["messages"]).encode()
    return str(data.get("prompt", "")).encode()


def _reply(request: dict, text: str, prompt_tokens: int) -> tuple[int, bytes, bytes]:
    usage = {
        "prompt_tokens": prompt_tokens + 5,
        "completion_tokens": len(text),
        "total_tokens": prompt_tokens + 5,
    }
    chat = "messages" in request
    if request.get("stream"):
        piece = {"delta": {"content": text}} if chat else {"text": text}
        events = [
            {"choices": [{"index": 0, **piece, "finish_reason": "stop"}]},
            {"choices": [], "usage": usage},
        ]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return 200, b"text/event-stream", body.encode()
    choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    return 200, b"application/json", json.dumps({"choices": [{"index": 0, **choice, "finish_reason": "stop"}],
                                                 "usage": usage}).encode()  # fmt: skip


class Protocol(asyncio.Protocol):
    def __init__(self, engine: Engine):
        self.engine = engine
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buffer[:head_end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if len(self.buffer) < head_end + 4 + length:
                return
            body = self.buffer[head_end + 4 : head_end + 4 + length]
            self.buffer = self.buffer[head_end + 4 + length :]
            method, path = head.split(b" ", 2)[:2]
            status, ctype, out = self.engine.answer(method, path, body)
            delay = self.engine.delay + (random.uniform(0, 0.005) if self.engine.noise else 0)
            self._send(status, ctype, out, delay)

    def _send(self, status: int, ctype: bytes, body: bytes, delay: float) -> None:
        reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 503: b"Service Unavailable"}[status]
        raw = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
            status,
            reason,
            ctype,
            len(body),
            body,
        )
        if delay:
            asyncio.get_running_loop().call_later(delay, self._write, raw)
        else:
            self._write(raw)

    def _write(self, raw: bytes) -> None:
        if not self.transport.is_closing():  # the monitor gave up on a delayed answer
            self.transport.write(raw)  # type: ignore[attr-defined]


async def serve(port: int, pool_tokens: int, noise: bool, delay: float = 0.0) -> None:
    engine = Engine(pool_tokens, noise, delay)
    server = await asyncio.get_running_loop().create_server(
        lambda: Protocol(engine), "127.0.0.1", port, backlog=4096
    )
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--pool-tokens", type=int, default=4096)
    parser.add_argument("--noise", action="store_true")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds every answer waits")
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.pool_tokens, args.noise, args.delay))


if __name__ == "__main__":
    main()
