"""The one validated settings object, read from a YAML file (see ``kvcanary.example.yml``).

Every key is checked at startup; :func:`load_settings` raises :class:`ConfigError` whose message
names the key and the problem (``targets[0].interval_seconds: must be greater than 0``), and the
CLI turns it into exit status 2. Secrets never sit in the file: tenant API keys and the REST token
come from environment variables or files named here, and are read by :func:`read_secret`.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Any, Literal

import httpx
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from probes import REGISTRY
from probes.base import Node

Engine = Literal["sglang", "vllm", "llamacpp", "reference", "openai"]
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DAY = 86400.0
# The REST token must not be a placeholder someone forgot to change.
WEAK_TOKENS = {"", "changeme", "change-me", "secret", "token", "password", "kvcanary"}


class ConfigError(Exception):
    """A configuration problem; ``str()`` names the key."""


class _Strict(BaseModel):
    # No inf/nan: an infinite interval or retention passes "> 0" and then overflows a timer.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class TenantConfig(_Strict):
    name: str
    api_key_env: str | None = None
    api_key_file: Path | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("must be 1-63 letters, digits, '_', '.', '-'")
        return v

    @field_validator("api_key_env")
    @classmethod
    def _env(cls, v: str | None) -> str | None:
        if v is not None and not ENV_RE.match(v):
            raise ValueError("must be an environment variable name")
        return v

    @model_validator(mode="before")
    @classmethod
    def _no_literal_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "api_key" in data:
            raise ValueError("api_key: literal keys are refused; use api_key_env or api_key_file")
        return data


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


class NodeConfig(_Strict):
    """One serving node of a target: a disaggregated deployment has prefill and decode nodes, each
    with its own pool, server info and metrics. Node-scoped probes (``counters``) judge each alone."""

    name: str
    role: Literal["single", "prefill", "decode"] = "single"
    # The node's own API (server info, tokenizer); default: the target's base_url.
    info_url: str | None = Field(None, max_length=2048)
    # Its Prometheus endpoint; default: <info_url>/metrics.
    metrics_url: str | None = Field(None, max_length=2048)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("must be 1-63 letters, digits, '_', '.', '-'")
        return v

    @field_validator("info_url", "metrics_url")
    @classmethod
    def _urls(cls, v: str | None) -> str | None:
        return None if v is None else http_url(v)


class TargetConfig(_Strict):
    name: str
    base_url: str = Field(max_length=2048)
    engine: Engine = "reference"
    model: str = Field("default", min_length=1, max_length=255)
    tenants: list[TenantConfig] = Field(min_length=1)
    interval_seconds: float = Field(30.0, gt=0, le=7 * DAY)
    timeout_seconds: float = Field(30.0, gt=0, le=3600)
    probes: list[str] = Field(default_factory=lambda: ["canary", "cross_tenant", "boundary"], min_length=1)
    # Per-kind interval override; the boundary probe is large and runs on its own, longer clock.
    probe_intervals: dict[str, float] = Field(default_factory=lambda: {"boundary": 300.0})
    # Per-kind options handed to the probe (e.g. boundary: {max_prompt_tokens: 2000000}).
    options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # The serving nodes behind base_url; none listed: one node at base_url.
    nodes: list[NodeConfig] = Field(default_factory=list, max_length=1000)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("must be 1-63 letters, digits, '_', '.', '-'")
        return v

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        """Accept ``http(s)://host[:port][/prefix]``; a trailing ``/v1`` is dropped (paths add it)."""
        return http_url(v).removesuffix("/v1").rstrip("/")

    @field_validator("probes")
    @classmethod
    def _known_probes(cls, v: list[str]) -> list[str]:
        unknown = [p for p in v if p not in REGISTRY]
        if unknown:
            raise ValueError(f"unknown probe kind(s) {unknown}; known: {sorted(REGISTRY)}")
        if len(set(v)) != len(v):
            raise ValueError("lists a probe kind twice")
        return v

    @field_validator("probe_intervals")
    @classmethod
    def _intervals(cls, v: dict[str, float]) -> dict[str, float]:
        _known(v)
        if any(not 0 < x <= 7 * DAY for x in v.values()):
            raise ValueError("intervals must be greater than 0 and at most 7 days")
        return v

    @field_validator("options")
    @classmethod
    def _options(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Check each kind's options against that kind's own model; keep only what was stated."""
        _known(v)
        checked = {}
        for kind, given in v.items():
            try:
                model = REGISTRY[kind].options_model.model_validate(given)
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in (kind, *err["loc"]))
                raise ValueError(f"{where}: {err['msg']}") from None
            checked[kind] = model.model_dump(exclude_unset=True)
        return checked

    @model_validator(mode="after")
    def _tenants(self) -> TargetConfig:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError("tenants: names must be unique")
        _no_shared_key_source(self.tenants)
        nodes = [n.name for n in self.nodes]
        if len(set(nodes)) != len(nodes):
            raise ValueError("nodes: names must be unique")
        if "cross_tenant" in self.probes and len(self.tenants) < 2:
            raise ValueError("tenants: the cross_tenant probe needs two or more tenants")
        return self

    def interval_for(self, kind: str) -> float:
        return float(self.probe_intervals.get(kind, self.interval_seconds))

    def node_list(self) -> list[Node]:
        """Return the target's nodes with every URL filled in; one unnamed node at base_url by default."""
        if not self.nodes:
            return [Node("", "single", self.base_url, f"{self.base_url}/metrics")]
        out = []
        for node in self.nodes:
            info = node.info_url or self.base_url
            out.append(Node(node.name, node.role, info, node.metrics_url or f"{info}/metrics"))
        return out


class ApiConfig(_Strict):
    listen: str = "127.0.0.1:8600"
    token_env: str = "KVCANARY_API_TOKEN"
    token_file: Path | None = None
    # Serve /api/v1 without a token. Only allowed on a loopback address.
    local_only: bool = False

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError("must be HOST:PORT, e.g. 127.0.0.1:8600")
        return v

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])

    @model_validator(mode="after")
    def _local_only_on_loopback(self) -> ApiConfig:
        if self.local_only and not _is_loopback(self.host):
            raise ValueError("local_only: an API without a token may only listen on a loopback address")
        return self


class IncidentConfig(_Strict):
    resolve_after_passes: int = Field(3, ge=1)
    # Errors (the probe could not judge) open a warning incident once they last this long.
    error_warning_after_seconds: float = Field(300.0, ge=0, le=7 * DAY)


class SchedulerConfig(_Strict):
    max_concurrency: int = Field(4, ge=1, le=64)
    jitter_seconds: float = Field(2.0, ge=0, le=3600)


class RetentionConfig(_Strict):
    pass_days: float = Field(7, gt=0, le=3650)
    failure_days: float = Field(90, gt=0, le=3650)


class SpoolConfig(_Strict):
    """Where results wait while the database is unreachable (``monitor/spool.py``)."""

    # Default: a folder under $KVCANARY_STATE_DIR (or ~/.local/state/kvcanary) named for the database.
    path: Path | None = None
    # Keep the spool in memory only: bounded the same way, lost when the process exits.
    in_memory: bool = False
    max_entries: int = Field(10_000, ge=10, le=10_000_000)


class Settings(_Strict):
    database_url: str = "sqlite:///kvcanary.db"
    api: ApiConfig = ApiConfig()
    targets: list[TargetConfig] = Field(default_factory=list)
    incidents: IncidentConfig = IncidentConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    retention: RetentionConfig = RetentionConfig()
    spool: SpoolConfig = SpoolConfig()
    marker_ttl_seconds: float = Field(6 * 3600, gt=0, le=30 * DAY)

    @field_validator("database_url")
    @classmethod
    def _db(cls, v: str) -> str:
        if not re.match(r"^(sqlite|postgresql)(\+\w+)?://", v):
            raise ValueError("must be sqlite:///PATH or postgresql+psycopg://USER@HOST/DB")
        return v

    @model_validator(mode="after")
    def _unique_targets(self) -> Settings:
        names = [t.name for t in self.targets]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"targets: duplicate name(s) {dupes}")
        return self

    def target(self, name: str) -> TargetConfig | None:
        return next((t for t in self.targets if t.name == name), None)


def _no_shared_key_source(tenants: list[TenantConfig]) -> None:
    """Refuse two tenants whose key comes from one variable or one file: they would be one tenant."""
    seen: dict[tuple[str, str], str] = {}
    for tenant in tenants:
        for source in (("api_key_env", tenant.api_key_env), ("api_key_file", tenant.api_key_file)):
            if source[1] is None:
                continue
            key = (source[0], str(source[1]))
            if key in seen:
                raise ValueError(
                    f"tenants: {seen[key]} and {tenant.name} take their key from the same {source[0]} "
                    f"{source[1]}; one key is one tenant to the engine"
                )
            seen[key] = tenant.name


def _known(kinds: dict[str, Any]) -> None:
    unknown = [p for p in kinds if p not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown probe kind(s) {unknown}; known: {sorted(REGISTRY)}")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _key_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).startswith(("function-", "literal[")):
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def parse_settings(data: Any, *, source: str = "config") -> Settings:
    """Validate already-parsed YAML; raise ConfigError naming the first bad keys."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys")
    overrides = {"database_url": os.environ.get("KVCANARY_DATABASE_URL")}
    data = {**data, **{k: v for k, v in overrides.items() if v}}
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors()[:5]:
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{_key_path(tuple(err['loc']))}: {msg}")
        raise ConfigError(f"{source}: " + "; ".join(lines)) from None


def load_settings(path: str | Path) -> Settings:
    """Read and validate the YAML file at ``path``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_settings(data, source=str(path))


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


def tenant_keys(settings: Settings) -> dict[tuple[str, str], str | None]:
    """Return every tenant's API key by (target, tenant). A named but unset variable is an error.

    A tenant with neither ``api_key_env`` nor ``api_key_file`` gets None (an engine without auth).
    Two tenants of one target with the same key are an error naming both: the engine sees one
    tenant, so each would read the other's markers as its own and every probe would cry leak.
    """
    keys: dict[tuple[str, str], str | None] = {}
    for i, target in enumerate(settings.targets):
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
    return keys


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
    if token.lower() in WEAK_TOKENS or len(token) < 16:
        raise ConfigError("api.token_env: the bearer token is a placeholder or shorter than 16 characters")
    return token
