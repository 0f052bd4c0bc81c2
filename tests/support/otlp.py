"""A real OTLP/HTTP logs receiver on loopback: decodes what an exporter sends, as a collector would.

Each ``POST /v1/logs`` is parsed as an ``ExportLogsServiceRequest`` (opentelemetry-proto, protobuf
or JSON, gzip or not) and kept with its headers and raw bytes; it answers an
``ExportLogsServiceResponse``, or ``status`` (and waits ``delay`` first) to play a collector that
refuses or hangs.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class Received:
    headers: dict[str, str]
    raw: bytes
    request: ExportLogsServiceRequest


@dataclass
class OtlpReceiver:
    url: str = ""
    received: list[Received] = field(default_factory=list)
    status: int = 200
    delay: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def events(self) -> list[dict[str, Any]]:
        """Return every log record received as {event_name, severity_text, time, attributes, resource}."""
        with self.lock:
            requests = [r.request for r in self.received]
        found = []
        for request in requests:
            for resource_logs in request.resource_logs:
                resource = {a.key: value_of(a.value) for a in resource_logs.resource.attributes}
                for scope in resource_logs.scope_logs:
                    for record in scope.log_records:
                        found.append({
                            "event_name": record.event_name,
                            "severity_text": record.severity_text,
                            "time": record.time_unix_nano,
                            "body": value_of(record.body) if record.HasField("body") else None,
                            "attributes": {a.key: value_of(a.value) for a in record.attributes},
                            "resource": resource,
                            "scope": scope.scope.name,
                        })  # fmt: skip
        return found

    def raw(self) -> bytes:
        with self.lock:
            return b"".join(r.raw for r in self.received)


def value_of(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """Run an :class:`OtlpReceiver` on a free loopback port for the ``with`` block."""
    receiver = OtlpReceiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            request = ExportLogsServiceRequest()
            if self.headers.get("Content-Type", "").startswith("application/json"):
                json_format.Parse(body, request)
            else:
                request.ParseFromString(body)
            time.sleep(receiver.delay)
            with receiver.lock:
                receiver.received.append(
                    Received({k.lower(): v for k, v in self.headers.items()}, body, request)
                )
            status = receiver.status if self.path == "/v1/logs" else 404
            answer = ExportLogsServiceResponse().SerializeToString()
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
