"""Secrets: tenant API keys, worker credentials, the REST token and the marker key, read from
environment variables or files.

Never from the config file itself, never logged, stored or returned. Each function raises
:class:`~monitor.config.settings.ConfigError` naming the key when a named secret is missing or unusable.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from pathlib import Path

from kvcanary.monitor.config.settings import ConfigError, Settings
from kvcanary.monitor.config.targets import TargetConfig

# The REST token must not be a placeholder someone forgot to change.
WEAK_TOKENS = {"", "changeme", "change-me", "secret", "token", "password", "kvcanary"}


def read_secret(*, env: str | None, file: Path | None, key: str) -> str | None:
    """Return the secret from ``file`` or the environment variable ``env``; None when neither is set.

    Raise ConfigError naming ``key`` when a file is named but unreadable or empty.
    """
    if file is not None:
        try:
            value = Path(file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"{key}: cannot read {file}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{key}: {file} is not UTF-8 text") from None
        if not value:
            raise ConfigError(f"{key}: {file} is empty")
        return value
    if env:
        value = os.environ.get(env, "").strip()
        return value or None
    return None


class TenantKeys(dict[tuple[str, str], str | None]):
    """Every tenant's API key by (target, tenant), and in ``workers`` each target's worker
    credential by target name (None: it states none). The mapping itself holds tenants' keys only
    (what the traffic judge knows the monitor's own requests by); a worker credential goes only
    where ``monitor/config/credentials.py`` lets it."""

    def __init__(
        self, tenants: dict[tuple[str, str], str | None], workers: dict[str, str | None] | None = None
    ):
        super().__init__(tenants)
        self.workers: dict[str, str | None] = dict(workers or {})


def tenant_keys(settings: Settings, only: list[str] | None = None) -> TenantKeys:
    """Return every tenant's API key by (target, tenant), and each target's worker credential, of
    the targets named in ``only`` when given. A named but unset variable is an error.

    A tenant with neither ``api_key_env`` nor ``api_key_file`` gets None (an engine without auth).
    Two tenants of one target with the same key are an error naming both: the engine sees one
    tenant, so each would read the other's markers as its own and every probe would cry leak. A
    worker credential that is one of its target's tenants' keys is an error naming the key.
    """
    keys: dict[tuple[str, str], str | None] = {}
    workers: dict[str, str | None] = {}
    for i, target in enumerate(settings.targets):
        if only is not None and target.name not in only:
            continue
        owners: dict[str, str] = {}
        for j, tenant in enumerate(target.tenants):
            where = f"targets[{i}].tenants[{j}]"
            key = read_secret(env=tenant.api_key_env, file=tenant.api_key_file, key=where + ".api_key_file")
            if key is None and tenant.api_key_env:
                raise ConfigError(
                    f"{where}.api_key_env: environment variable {tenant.api_key_env} is not set"
                )
            if key is not None and key in owners:
                raise ConfigError(
                    f"targets[{i}].tenants: {owners[key]} and {tenant.name} have the same API key; "
                    "give each tenant its own key"
                )
            if key is not None:
                owners[key] = tenant.name
            keys[(target.name, tenant.name)] = key
        workers[target.name] = _worker_key(target, f"targets[{i}]", owners)
    return TenantKeys(keys, workers)


def _worker_key(target: TargetConfig, where: str, owners: dict[str, str]) -> str | None:
    """Return ``target``'s worker credential, or None where it states none; raise ConfigError
    naming the key when a named one is missing or is a tenant's (``owners``: tenant by key)."""
    key = read_secret(
        env=target.worker_api_key_env, file=target.worker_api_key_file, key=where + ".worker_api_key_file"
    )
    named = where + (".worker_api_key_file" if target.worker_api_key_file else ".worker_api_key_env")
    if key is None and target.worker_api_key_env:
        raise ConfigError(f"{named}: environment variable {target.worker_api_key_env} is not set")
    if key is not None and key in owners:
        raise ConfigError(
            f"{named}: the worker credential is tenant {owners[key]}'s API key; give the workers their own"
        )
    return key


def api_token(settings: Settings) -> str | None:
    """Return the REST bearer token, None when the API runs local-only, or raise ConfigError."""
    api = settings.api
    token = read_secret(env=api.token_env, file=api.token_file, key="api.token_file")
    if token is None:
        if api.local_only:
            return None
        raise ConfigError(
            f"api.token_env: set {api.token_env} (or api.token_file) to a bearer token, "
            "or set api.local_only: true to serve the API without one on loopback"
        )
    where = "api.token_file" if api.token_file is not None else "api.token_env"
    if token.lower() in WEAK_TOKENS or len(token) < 16:
        raise ConfigError(f"{where}: the bearer token is a placeholder or shorter than 16 characters")
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        # A header carries Latin-1 at best: such a token could never be sent back, and every call would 401.
        raise ConfigError(f"{where}: the bearer token must be printable ASCII without spaces")
    return token


def ingest_token(settings: Settings) -> str | None:
    """Return the traffic ingest token (it may post to ``/api/v1/traffic`` and read nothing), or
    None when none is set; raise ConfigError for a weak one."""
    traffic = settings.traffic
    token = read_secret(
        env=traffic.ingest_token_env, file=traffic.ingest_token_file, key="traffic.ingest_token_file"
    )
    if token is None:
        return None
    where = (
        "traffic.ingest_token_file" if traffic.ingest_token_file is not None else "traffic.ingest_token_env"
    )
    if token.lower() in WEAK_TOKENS or len(token) < 16:
        raise ConfigError(f"{where}: the ingest token is a placeholder or shorter than 16 characters")
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise ConfigError(f"{where}: the ingest token must be printable ASCII without spaces")
    return token


def litellm_db_url(settings: Settings) -> str | None:
    """Return the URL of LiteLLM's database a blast radius reads, or None when none is named."""
    blast = settings.blast_radius
    return read_secret(
        env=blast.litellm_db_url_env, file=blast.litellm_db_url_file, key="blast_radius.litellm_db_url_file"
    )


def alertmanager_headers(settings: Settings) -> dict[str, dict[str, str]]:
    """Return the request headers for each configured Alertmanager, by URL (auth, when configured).

    Raise ConfigError naming the key when a named secret is missing.
    """
    out: dict[str, dict[str, str]] = {}
    for i, am in enumerate(settings.alertmanagers):
        where = f"alertmanagers[{i}]"
        headers: dict[str, str] = {}
        if am.bearer_token_env or am.bearer_token_file:
            token = read_secret(
                env=am.bearer_token_env, file=am.bearer_token_file, key=where + ".bearer_token_file"
            )
            if token is None:
                raise ConfigError(
                    f"{where}.bearer_token_env: environment variable {am.bearer_token_env} is not set"
                )
            headers["Authorization"] = f"Bearer {token}"
        elif am.basic_auth_user:
            password = read_secret(
                env=am.basic_auth_password_env,
                file=am.basic_auth_password_file,
                key=where + ".basic_auth_password_file",
            )
            if password is None:
                env = am.basic_auth_password_env
                raise ConfigError(f"{where}.basic_auth_password_env: environment variable {env} is not set")
            pair = base64.b64encode(f"{am.basic_auth_user}:{password}".encode()).decode()
            headers["Authorization"] = f"Basic {pair}"
        out[am.url] = headers
    return out


#: Fewest characters a stated marker key may have: it seals every marker for the TTL.
MARKER_KEY_CHARS = 32


def marker_key(settings: Settings, token: str | None) -> bytes | None:
    """Return the key that seals markers, shared by every replica and kept across restarts.

    A stated key (``marker_key_file``, or the variable ``marker_key_env`` names) wins; without one
    the key is derived from the API token, which replicas already share (a token holder could then
    forge a marker: state a key of its own to keep them apart). None when there is neither: the
    process seals with a random key of its own, and a restarted monitor no longer recognises the
    markers it planted before (a single local process only).
    """
    stated = read_secret(env=settings.marker_key_env, file=settings.marker_key_file, key="marker_key_file")
    if stated is not None:
        if len(stated) < MARKER_KEY_CHARS:
            where = "marker_key_file" if settings.marker_key_file is not None else "marker_key_env"
            raise ConfigError(f"{where}: the marker key is shorter than {MARKER_KEY_CHARS} characters")
        return hashlib.sha256(b"kvcanary marker key\0" + stated.encode()).digest()
    if token is None:
        return None
    return hmac.new(token.encode(), b"kvcanary marker key", hashlib.sha256).digest()
