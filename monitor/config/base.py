"""What every settings model shares: :class:`Strict` (unknown keys refused, no inf/nan), the name
rules for targets, tenants, nodes and environment variables, and the one form of an HTTP URL the
config accepts."""

from __future__ import annotations

import re
from typing import Annotated

import httpx
from pydantic import AfterValidator, BaseModel, ConfigDict

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DAY = 86400.0


class Strict(BaseModel):
    # No inf/nan: an infinite interval or retention passes "> 0" and then overflows a timer.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _name(value: str) -> str:
    if not NAME_RE.match(value):
        raise ValueError("must be 1-63 letters, digits, '_', '.', '-'")
    return value


def _env_name(value: str) -> str:
    if not ENV_RE.match(value):
        raise ValueError("must be an environment variable name")
    return value


#: A target, tenant or node name (``NAME_RE``).
Name = Annotated[str, AfterValidator(_name)]
#: The name of an environment variable a secret is read from (``ENV_RE``).
EnvName = Annotated[str, AfterValidator(_env_name)]


def http_url(v: str) -> str:
    """Accept ``http(s)://host[:port][/prefix]`` without credentials, query or fragment; raise ValueError."""
    try:
        url = httpx.URL(v)
    except (httpx.InvalidURL, ValueError) as exc:
        raise ValueError(f"not a valid URL: {exc}") from None
    if url.port is not None and not 0 < url.port < 65536:
        raise ValueError(f"not a valid URL: port {url.port} is out of range")
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError("must be an http:// or https:// URL with a host")
    if url.userinfo:
        # Credentials in a URL end up in logs, rows and error messages; keys belong to tenants.
        raise ValueError("must not carry credentials; use the tenants' api_key_env or api_key_file")
    if url.query or url.fragment:
        raise ValueError("must not carry a query string or fragment")
    return v.rstrip("/")
