"""A recording stand-in for the part of Grafana's HTTP API that ``kvcanary dashboards push`` calls.

No Grafana server can run in these tests (Debian and PyPI ship none), so this loopback server
answers the three documented calls the way Grafana's HTTP API reference says, and records every
request for the test to assert on:

- ``GET /api/folders/:uid`` → 200 with the folder, or 404 when there is none.
- ``POST /api/folders`` ``{"uid", "title"}`` → 200 with ``{id, uid, title, url, version, ...}``;
  409 when the uid exists.
- ``POST /api/dashboards/db`` ``{"dashboard", "folderUid", "overwrite", "message"}`` → 200 with
  ``{id, uid, url, status: "success", version, slug}``; 412 ``{"message": "The dashboard has been
  changed by someone else", "status": "version-mismatch"}`` when a dashboard with that uid exists,
  its version differs and ``overwrite`` is false; 400 for a missing field or folder.
- Any request without ``Authorization: Bearer <the token>`` → 401.

Sources: Grafana's "Dashboard HTTP API" (``POST /api/dashboards/db``, "Create / Update dashboard")
and "Folder HTTP API" (``GET /api/folders/:uid``, ``POST /api/folders``) reference pages,
https://grafana.com/docs/grafana/v11.6/developers/http_api/dashboard/ and
https://grafana.com/docs/grafana/v11.6/developers/http_api/folder/ (the same text is in the
grafana repository, grafana/grafana:docs/sources/developers/http_api/dashboard.md and folder.md).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class GrafanaStub:
    """Grafana's folder and dashboard state, and every request received, in order."""

    token: str
    folders: dict[str, dict[str, Any]] = field(default_factory=dict)
    dashboards: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> GrafanaStub:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                stub._handle(self, "GET")

            def do_POST(self) -> None:
                stub._handle(self, "POST")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        self.requests.append(Request(method, handler.path, dict(handler.headers.items()), body))
        status, answer = self._answer(method, handler.path, handler.headers.get("Authorization"), body)
        data = json.dumps(answer).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _answer(self, method: str, path: str, auth: str | None, body: Any) -> tuple[int, dict[str, Any]]:
        if auth != f"Bearer {self.token}":
            return 401, {"message": "Unauthorized"}
        folder = re.fullmatch(r"/api/folders/([\w-]+)", path)
        if method == "GET" and folder:
            found = self.folders.get(folder.group(1))
            return (200, found) if found else (404, {"message": "Folder not found", "status": "not-found"})
        if method == "POST" and path == "/api/folders":
            return self._create_folder(body)
        if method == "POST" and path == "/api/dashboards/db":
            return self._save_dashboard(body)
        return 404, {"message": "Not found"}

    def _create_folder(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if not body.get("title"):
            return 400, {"message": "folder title cannot be empty"}
        uid = body.get("uid") or f"f{len(self.folders) + 1}"
        if uid in self.folders:
            return 409, {"message": "a folder with the same uid already exists"}
        self.folders[uid] = {
            "id": len(self.folders) + 1,
            "uid": uid,
            "title": body["title"],
            "url": f"/dashboards/f/{uid}/{slug(body['title'])}",
            "hasAcl": False,
            "canSave": True,
            "canEdit": True,
            "canAdmin": True,
            "version": 1,
        }
        return 200, self.folders[uid]

    def _save_dashboard(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        dashboard = body.get("dashboard")
        if not isinstance(dashboard, dict) or not dashboard.get("title"):
            return 400, {"message": "Dashboard title cannot be empty"}
        if body.get("folderUid") and body["folderUid"] not in self.folders:
            return 400, {"message": "folder not found"}
        uid = dashboard.get("uid") or f"d{len(self.dashboards) + 1}"
        stored = self.dashboards.get(uid)
        if stored and not body.get("overwrite") and dashboard.get("version") != stored["version"]:
            return 412, {
                "message": "The dashboard has been changed by someone else",
                "status": "version-mismatch",
            }
        version = stored["version"] + 1 if stored else 1
        number = stored["id"] if stored else len(self.dashboards) + 1
        self.dashboards[uid] = {**dashboard, "id": number, "uid": uid, "version": version}
        self.dashboards[uid]["__folderUid"] = body.get("folderUid", "")
        name = slug(dashboard["title"])
        return 200, {"id": number, "uid": uid, "url": f"/d/{uid}/{name}", "status": "success",
                     "version": version, "slug": name}  # fmt: skip


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
