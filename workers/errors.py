"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, and their handlers.

| situation                                   | status | type                   | code              |
|---------------------------------------------|--------|------------------------|-------------------|
| malformed JSON, missing or mistyped field   | 400    | invalid_request_error  | 400               |
| empty or non-string ``cache_salt``          | 400    | invalid_request_error  | 400               |
| prompt over the context window or KV pool   | 400    | BadRequestError        | 400               |
| wrong or missing API key                    | 401    | authentication_error   | invalid_api_key   |
| unknown model                               | 404    | invalid_request_error  | model_not_found   |
| unknown route / method                      | 404/405| invalid_request_error  | the status        |
| KV page ownership check failed              | 500    | kv_ownership_violation | 500               |
| anything else                               | 500    | internal_error         | 500               |

``param`` names the offending field when there is one; the ownership error carries no ``param``.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("kvcanary.workers.errors")


class WorkerError(Exception):
    """An error answered in OpenAI's shape with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: int | str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code if code is not None else status
        self.param = param

    def body(self) -> dict[str, Any]:
        """Return the JSON body ``{"error": {...}}``."""
        error: dict[str, Any] = {"message": self.message, "type": self.type, "code": self.code}
        if self.param is not None:
            error["param"] = self.param
        return {"error": error}

    def response(self) -> JSONResponse:
        """Return the error as a JSON response."""
        return JSONResponse(self.body(), status_code=self.status)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """Return a one-line message naming the first bad field, and that field's dotted name."""
    first = exc.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "Request body is not valid JSON.", None
    if not location:
        if kind == "missing":
            return "Request body is missing: send a JSON object.", None
        return "Request body must be a JSON object.", None
    field = ".".join(location)
    if kind == "parameter":  # a validator's own sentence, naming the field itself (vLLM's wording)
        return f"{first.get('msg', 'invalid')}.", field
    if kind == "missing":
        return f"Missing required field '{field}'.", field
    return f"Invalid value for '{field}': {first.get('msg', 'invalid')}.", field


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in OpenAI's shape; validation errors become 400, not 422."""

    @app.exception_handler(WorkerError)
    async def on_worker_error(request: Request, exc: WorkerError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, field = validation_message(exc)
        return WorkerError(400, message, param=field).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return WorkerError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return WorkerError(500, "internal server error", type="internal_error").response()
