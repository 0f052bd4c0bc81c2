"""The statuses an operation answers besides its own, stated once, so that ``/openapi.json`` lists
every status the API returns.

- 401 (a ``Problem`` and ``WWW-Authenticate: Bearer``): every operation that takes a bearer token.
  :func:`install` adds it to each operation whose ``security`` names one, whichever router it
  comes from, so a new router cannot forget it.
- 400 (a ``Problem``): FastAPI's answer to a JSON body it cannot read as text (bytes that are not
  UTF-8); a body that is text but not JSON is a 422 naming ``body``. Added to each operation that
  takes a request body.
- 503 (a ``Problem`` and ``Retry-After``): the database does not answer (``outage.py``). Routers
  that read it state :data:`UNAVAILABLE`; only they know that they do.
- 405: a method a path does not serve. Starlette's ``Allow`` names the methods of the first route
  whose path matched, so a path served by two routes (``GET`` and ``DELETE`` of one resource,
  or two routers sharing a prefix) named only one; :func:`install` names them all.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exception_handlers import http_exception_handler
from starlette.exceptions import HTTPException
from starlette.routing import Match

from kvcanary.monitor.api.outage import RETRY_AFTER_SECONDS
from kvcanary.monitor.api.schemas import Problem

#: An OpenAPI ``responses`` entry as FastAPI takes it.
Responses = dict[int | str, dict[str, Any]]


def header(description: str) -> dict[str, Any]:
    """Return the OpenAPI description of a response header that is always sent."""
    return {"description": description, "required": True, "schema": {"type": "string"}}


#: Say why a request was refused for its token.
UNAUTHORIZED: Responses = {
    401: {
        "model": Problem,
        "description": "Missing or invalid bearer token.",
        "headers": {"WWW-Authenticate": header("`Bearer`.")},
    }
}

_UNAVAILABLE_TEXT = "The database does not answer; retry after `Retry-After` seconds."
_RETRY_AFTER = header(f"Seconds to wait before asking again ({RETRY_AFTER_SECONDS}).")

#: Say that the database is away, on an operation that reads it (``outage.py`` answers it).
UNAVAILABLE: Responses = {
    503: {"model": Problem, "description": _UNAVAILABLE_TEXT, "headers": {"Retry-After": _RETRY_AFTER}}
}

#: :data:`UNAVAILABLE` for an operation whose own answers are not JSON (HTML, Markdown): a
#: ``model`` would be documented under the operation's own media type, the error is JSON.
UNAVAILABLE_AS_JSON: Responses = {
    503: {
        "description": _UNAVAILABLE_TEXT,
        "headers": {"Retry-After": _RETRY_AFTER},
        "content": {"application/json": {"schema": Problem.model_json_schema()}},
    }
}


def problem_as_json(description: str) -> dict[str, Any]:
    """Return a ``Problem`` response for an operation whose own answers are not JSON."""
    return {
        "description": description,
        "content": {"application/json": {"schema": Problem.model_json_schema()}},
    }


_UNREADABLE_BODY = "The body is not text (not UTF-8); a body that is text but not JSON is a 422."


def install(app: FastAPI) -> None:
    """Document 401 and 400 on every operation of ``app`` that can answer them, and answer 405 with
    every method the path serves. Call it once every route is added."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        first = app.openapi_schema is None
        document = build()
        if first:  # FastAPI keeps the document it built: complete it once
            _complete(document)
        return document

    app.openapi = openapi  # type: ignore[method-assign]

    async def not_allowed(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            exc.headers = {**(exc.headers or {}), "Allow": ", ".join(_allowed(app, request))}
        return await http_exception_handler(request, exc)

    app.add_exception_handler(HTTPException, not_allowed)


def _complete(document: dict[str, Any]) -> None:
    problem = {"$ref": "#/components/schemas/Problem"}
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.setdefault("Problem", Problem.model_json_schema())
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            answers = operation.setdefault("responses", {})
            if operation.get("security"):
                refused = answers.setdefault("401", _entry(UNAUTHORIZED[401], problem))
                refused.setdefault("headers", copy.deepcopy(UNAUTHORIZED[401]["headers"]))
            if "requestBody" in operation:
                answers.setdefault("400", _entry({"description": _UNREADABLE_BODY}, problem))


def _entry(response: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    entry = {key: copy.deepcopy(value) for key, value in response.items() if key != "model"}
    return entry | {"content": {"application/json": {"schema": dict(schema)}}}


#: The methods a 405 may name: those of HTTP's own, which FastAPI routes serve.
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _allowed(app: FastAPI, request: Request) -> list[str]:
    """Return the methods some route of ``app`` serves at the request's path, by asking each route
    whether it would take the request under that method (as the router itself asks)."""
    return [
        method
        for method in _METHODS
        if any(
            route.matches({**request.scope, "method": method})[0] is Match.FULL for route in app.router.routes
        )
    ]
