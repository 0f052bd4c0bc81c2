"""API keys → tenants.

With keys configured (``--api-key KEY=TENANT``, ``--api-keys-file``) a request must carry
``Authorization: Bearer KEY`` for one of them, and KEY's tenant is the request's tenant; anything
else is a 401. With no keys configured every request is accepted and the bearer token itself names
its tenant (``anonymous`` without one), which keeps tests and demos free of setup. Keys are never
logged or echoed back.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kvcanary.workers.errors import WorkerError

ANONYMOUS = "anonymous"


def parse_key_spec(spec: str, *, source: str) -> tuple[str, str]:
    """Return ``(key, tenant)`` from ``KEY=TENANT``; raise ``ValueError`` naming ``source`` otherwise."""
    key, sep, tenant = spec.partition("=")
    if not sep or not key.strip() or not tenant.strip():
        raise ValueError(f"{source}: expected KEY=TENANT, got an entry without both parts")
    return key.strip(), tenant.strip()


def load_keys_file(path: str) -> dict[str, str]:
    """Return the keys of a file of ``KEY=TENANT`` lines (blank lines and ``#`` comments skipped).

    Raises ``ValueError`` naming ``--api-keys-file`` when the file cannot be read or a line is bad.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"--api-keys-file: cannot read {path}: {exc.strerror}") from exc
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if line and not line.startswith("#"):
            key, tenant = parse_key_spec(line, source=f"--api-keys-file line {number}")
            keys[key] = tenant
    return keys


def resolve_tenant(authorization: str | None, keys: Mapping[str, str]) -> str:
    """Return the tenant of an ``Authorization`` header; raise a 401 ``WorkerError`` for a bad key."""
    token = _bearer_token(authorization)
    if not keys:
        return token or ANONYMOUS
    if token is None:
        raise WorkerError(
            401,
            "Missing API key: send 'Authorization: Bearer <key>'.",
            type="authentication_error",
            code="invalid_api_key",
        )
    tenant = keys.get(token)
    if tenant is None:
        raise WorkerError(
            401, "Incorrect API key provided.", type="authentication_error", code="invalid_api_key"
        )
    return tenant


def _bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
