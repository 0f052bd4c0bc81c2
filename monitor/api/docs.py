"""``/docs``: the OpenAPI explorer served from this process, never from a CDN.

FastAPI's default page loads Swagger UI from a CDN: a monitor inside a closed network would show a
blank page, and every visit would tell a third party that someone opened it. The assets ship with
the ``swagger-ui-bundle`` package and are mounted under ``/docs/static``.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

STATIC = "/docs/static"


def serve_docs(app: FastAPI) -> None:
    """Add ``/docs`` (Swagger UI from local assets) to ``app``, which must be built with ``docs_url=None``."""
    app.mount(STATIC, StaticFiles(directory=swagger_ui_path), name="docs-static")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} API",
            swagger_js_url=f"{STATIC}/swagger-ui-bundle.js",
            swagger_css_url=f"{STATIC}/swagger-ui.css",
            swagger_favicon_url=f"{STATIC}/favicon-32x32.png",
        )
