"""A small test gateway in front of vLLM that isolates tenants with ``cache_salt``, as vLLM advises.

vLLM salts a request's prefix-cache keys with its ``cache_salt`` field; only requests with the same
salt share pages. The salt must be set by the gateway, never chosen by the client (vLLM PR #53347):
this gateway maps each API key to a tenant and sets ``cache_salt`` to that tenant's secret (256
random bits made at start). A salt the client sent itself is appended to the tenant's
(``<tenant secret>.<client salt>``), so a client can split its own cache further but never reach
another tenant's: the secret is never sent back.

Only ``POST /v1/completions`` and ``/v1/chat/completions`` need a key (401 otherwise); other paths
(``/v1/models``, ``/metrics``, ``/tokenize``, ``/version``) pass through unchanged, as the monitor's
lookups need them. Answers, event streams included, are relayed chunk by chunk as they arrive and
the connection is closed after each (HTTP/1.0 framing). Loopback only; for tests.

Usage::

    with SaltGateway(vllm_url, {"key-a": "alice", "key-b": "bob"}) as url:
        ...  # send completions to url with "Authorization: Bearer key-a"
"""

from __future__ import annotations

import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

SALTED_PATHS = ("/v1/completions", "/v1/chat/completions")
#: Headers relayed from vLLM's answer (the rest describe the upstream connection, not the answer).
RELAYED_HEADERS = ("content-type",)


class SaltGateway:
    """A loopback proxy that injects a per-tenant ``cache_salt``; a context manager returning its URL.

    ``keys`` maps API keys to tenant names. ``salted`` counts the requests salted per tenant.
    """

    def __init__(self, upstream: str, keys: dict[str, str]) -> None:
        self.upstream = upstream.rstrip("/")
        self.keys = dict(keys)
        self.tenant_salts = {tenant: secrets.token_urlsafe(32) for tenant in set(keys.values())}
        self.salted: dict[str, int] = {tenant: 0 for tenant in self.tenant_salts}
        self._client = httpx.Client(base_url=self.upstream, timeout=httpx.Timeout(120.0))
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> str:
        """Serve on a thread; return the URL."""
        self._thread = threading.Thread(target=self._server.serve_forever, name="salt-gateway", daemon=True)
        self._thread.start()
        return self.url

    def stop(self) -> None:
        """Stop serving and close the upstream client."""
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._client.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def tenant_of(self, authorization: str | None) -> str | None:
        """Return the tenant of a ``Bearer`` header, or None for a missing or unknown key."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        return self.keys.get(authorization.removeprefix("Bearer ").strip())

    def salt_body(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        """Return ``body`` with the tenant's salt set (the client's own salt appended, if any)."""
        own = body.get("cache_salt")
        tenant_salt = self.tenant_salts[tenant]
        self.salted[tenant] += 1
        return {**body, "cache_salt": f"{tenant_salt}.{own}" if isinstance(own, str) and own else tenant_salt}

    def forward(self, handler: BaseHTTPRequestHandler, method: str, body: bytes | None) -> None:
        """Send the request upstream and relay the answer to ``handler`` as it arrives."""
        headers = {"content-type": "application/json"} if body is not None else {}
        request = self._client.build_request(method, handler.path, content=body, headers=headers)
        try:
            response = self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            _reply_error(handler, 502, f"upstream unreachable: {exc}")
            return
        try:
            handler.send_response(response.status_code)
            for name in RELAYED_HEADERS:
                if name in response.headers:
                    handler.send_header(name, response.headers[name])
            handler.send_header("connection", "close")
            handler.end_headers()
            for chunk in response.iter_raw():
                handler.wfile.write(chunk)
                handler.wfile.flush()  # a stream's events must reach the client as they come
        finally:
            response.close()


def _reply_error(handler: BaseHTTPRequestHandler, status: int, message: str) -> None:
    payload = json.dumps({"error": {"message": message, "type": "GatewayError", "code": status}}).encode()
    handler.send_response(status)
    handler.send_header("content-type", "application/json")
    handler.send_header("content-length", str(len(payload)))
    handler.end_headers()
    handler.wfile.write(payload)


def _handler_for(gateway: SaltGateway) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            gateway.forward(self, "GET", None)

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
            if self.path.split("?")[0] not in SALTED_PATHS:
                gateway.forward(self, "POST", raw)
                return
            tenant = gateway.tenant_of(self.headers.get("authorization"))
            if tenant is None:
                _reply_error(self, 401, "missing or unknown API key")
                return
            try:
                body = json.loads(raw)
            except ValueError:
                _reply_error(self, 400, "the body is not JSON")
                return
            if not isinstance(body, dict):
                _reply_error(self, 400, "the body is not a JSON object")
                return
            gateway.forward(self, "POST", json.dumps(gateway.salt_body(tenant, body)).encode())

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: pytest shows failures, not every proxied request

    return Handler
