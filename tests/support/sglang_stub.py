"""An SGLang node at the network seam, for the one engine these machines cannot run (CUDA only).

It answers what the monitor asks an SGLang node, in SGLang's shapes: ``/server_info`` from a
recorded fixture (``tests/fixtures/engines``), ``/v1/models``, ``/tokenize`` (one token per byte,
like the reference worker, so prompt sizes are exact), and completions. Its admission follows the
version it claims: before 0.5.22 in PD mode an over-capacity prompt is swapped for the one-token
placeholder and answered 200 with ``prompt_tokens = 1`` (sgl-project/sglang#30233); from 0.5.22 it
is refused with SGLang's 400. Every request is recorded, so a test can say which ones were sent.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ENGINES = Path(__file__).resolve().parents[1] / "fixtures" / "engines"


@dataclass
class SGLangStub:
    """A running stub; ``requests`` holds (method, path) of everything it was asked."""

    info: dict[str, Any]
    #: Its ``/metrics`` page (Prometheus text), or None: 404.
    metrics: str | None = None
    requests: list[tuple[str, str]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def completions(self) -> int:
        return sum(1 for method, path in self.requests if path.endswith("completions"))

    def defective(self) -> bool:
        major_minor_patch = tuple(int(p) for p in str(self.info["version"]).split(".")[:3])
        return self.info.get("disaggregation_mode") in ("prefill", "decode") and major_minor_patch < (
            0,
            5,
            22,
        )

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def start_sglang_stub(fixture: str, metrics: str | None = None) -> SGLangStub:
    """Serve ``tests/fixtures/engines/<fixture>`` as a node's /server_info on a free loopback port,
    and the fixture ``metrics`` names, if any, as its /metrics."""
    page = None if metrics is None else (ENGINES / metrics).read_text()
    stub = SGLangStub(json.loads((ENGINES / fixture).read_text()), page)
    stub.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(stub))
    threading.Thread(target=stub.server.serve_forever, daemon=True).start()
    return stub


def _handler(stub: SGLangStub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet: the test reads ``requests``
            return

        def do_GET(self) -> None:
            stub.requests.append(("GET", self.path))
            if self.path in ("/server_info", "/get_server_info"):
                self._json(200, stub.info)
            elif self.path == "/metrics" and stub.metrics is not None:
                raw = stub.metrics.encode()
                self.send_response(200)
                self.send_header("content-type", "text/plain; version=0.0.4")
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
            elif self.path == "/v1/models":
                self._json(
                    200,
                    {"object": "list", "data": [{"id": "glm", "max_model_len": stub.info["context_length"]}]},
                )
            else:
                self._json(
                    404, {"object": "error", "message": "Not Found", "type": "NotFoundError", "code": 404}
                )

        def do_POST(self) -> None:
            stub.requests.append(("POST", self.path))
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
            if self.path == "/tokenize":
                self._json(200, {"tokens": [], "count": len(str(body.get("prompt", "")).encode())})
            elif self.path.endswith("completions"):
                self._complete(body)
            else:
                self._json(
                    404, {"object": "error", "message": "Not Found", "type": "NotFoundError", "code": 404}
                )

        def _complete(self, body: dict[str, Any]) -> None:
            prompt = str(
                body.get("prompt") or "".join(m.get("content", "") for m in body.get("messages", []))
            )
            tokens, limit = len(prompt.encode()), int(stub.info["max_req_input_len"])
            if tokens > limit and not stub.defective():
                message = (
                    f"Input length ({tokens} tokens) exceeds the maximum allowed length ({limit} tokens)."
                )
                self._json(
                    400, {"object": "error", "message": message, "type": "BadRequestError", "code": 400}
                )
                return
            # The defect: the prompt became a one-token placeholder; decode read stale pages.
            text, reported = (
                ("stale page of an earlier request", 1) if tokens > limit else (prompt[:64], tokens)
            )
            choice = {"index": 0, "text": text, "message": {"role": "assistant", "content": text}}
            usage = {"prompt_tokens": reported, "completion_tokens": 8, "total_tokens": reported + 8}
            self._json(200, {"choices": [{**choice, "finish_reason": "length"}], "usage": usage})

        def _json(self, status: int, data: Any) -> None:
            raw = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    return Handler
