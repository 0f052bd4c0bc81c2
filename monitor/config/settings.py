"""The one validated settings object, read from a YAML file (see ``kvcanary.example.yml``).

Every key is checked at startup; :func:`load_settings` raises :class:`ConfigError` whose message
names the key and the problem (``targets[0].interval_seconds: must be greater than 0``), and the
CLI turns it into exit status 2. Secrets never sit in the file: tenant API keys and the REST token
come from environment variables or files named here, and are read by :mod:`monitor.config.secrets`.
What is probed (targets, tenants, nodes) is described in :mod:`monitor.config.targets`.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from kvcanary.monitor.config.base import DAY, EnvName, Strict, http_url
from kvcanary.monitor.config.containment_policy import ContainmentPolicy
from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.probes.yamlfile import DuplicateKeyError, error_lines, load_yaml
from kvcanary.wire import QUARANTINE_BUCKET


class ConfigError(Exception):
    """A configuration problem; ``str()`` names the key."""


class ApiConfig(Strict):
    listen: str = "127.0.0.1:8600"
    token_env: EnvName = "KVCANARY_API_TOKEN"
    token_file: Path | None = None
    # Serve /api/v1 without a token. Only allowed on a loopback address.
    local_only: bool = False
    # How people reach this monitor: links in alerts (incidents, runbooks). Default: http://<listen>.
    public_url: str | None = Field(None, max_length=2048)
    # SIGTERM: probing stops at once; runs and requests still going after this long are cancelled.
    shutdown_grace_seconds: float = Field(5.0, ge=0, le=600)
    # A target run on request (POST .../run) is not run again on request sooner than this.
    run_now_min_interval_seconds: float = Field(10.0, ge=0, le=86400)

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, v: str | None) -> str | None:
        return None if v is None else http_url(v)

    @property
    def base_url(self) -> str:
        return self.public_url or f"http://{self.listen}"

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


class IncidentConfig(Strict):
    resolve_after_passes: int = Field(3, ge=1)
    # Errors (the probe could not judge) open a warning incident once they last this long.
    error_warning_after_seconds: float = Field(300.0, ge=0, le=7 * DAY)


class SchedulerConfig(Strict):
    # Runs in flight at once, across targets. A run mostly waits on the network: thousands of
    # targets need dozens in flight (5,000 canaries at 30 s are ~170 runs a second).
    max_concurrency: int = Field(32, ge=1, le=1024)
    # At most this many of them on one target (a node-scoped kind runs its nodes within it).
    max_concurrency_per_target: int = Field(4, ge=1, le=1024)
    # A run still waiting on its target after this long (or its timeout, when shorter) gives its
    # slot to the next run and waits on in overtime, of which at most max_overtime_runs at once.
    slot_lease_seconds: float = Field(1.0, gt=0, le=3600)
    # Targets not known to be quick (their last run outlived its lease or timed out, or they have
    # not run yet) share at most this part of the slots, so quick ones never wait behind them.
    slow_share: float = Field(0.5, gt=0, le=1)
    max_overtime_runs: int = Field(1024, ge=0, le=100_000)
    jitter_seconds: float = Field(2.0, ge=0, le=3600)


class RetentionConfig(Strict):
    pass_days: float = Field(7, gt=0, le=3650)
    failure_days: float = Field(90, gt=0, le=3650)
    # Excerpts of what a target returned can be another customer's text: purged after this many
    # days while the verdict, figures and marker ids stay.
    excerpt_days: float = Field(7, gt=0, le=3650)


class EvidenceConfig(Strict):
    # false: never store an excerpt of target output at all (marker ids, hashes and figures only).
    excerpts: bool = True


class SpoolConfig(Strict):
    """Where results wait while the database is unreachable (``monitor/recording/spool.py``)."""

    # Default: a folder under $KVCANARY_STATE_DIR (or ~/.local/state/kvcanary) named for the database.
    path: Path | None = None
    # Keep the spool in memory only: bounded the same way, lost when the process exits.
    in_memory: bool = False
    max_entries: int = Field(10_000, ge=10, le=10_000_000)


class LimitsConfig(Strict):
    """The most the monitor reads of anything a target sends (``monitor/targets/openai_format.py``)."""

    response_bytes: int = Field(4 * 1024 * 1024, ge=4096, le=1024**3)
    sse_line_bytes: int = Field(256 * 1024, ge=1024, le=1024**3)
    lookup_bytes: int = Field(8 * 1024 * 1024, ge=4096, le=1024**3)


class AlertmanagerConfig(Strict):
    """One Alertmanager (API v2). Written as a plain URL, or with auth whose secret is in env or a file."""

    url: str = Field(max_length=2048)
    bearer_token_env: EnvName | None = None
    bearer_token_file: Path | None = None
    basic_auth_user: str | None = Field(None, max_length=255)
    basic_auth_password_env: EnvName | None = None
    basic_auth_password_file: Path | None = None

    @model_validator(mode="before")
    @classmethod
    def _plain_url(cls, data: Any) -> Any:
        return {"url": data} if isinstance(data, str) else data

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return http_url(v)

    @model_validator(mode="after")
    def _one_auth(self) -> AlertmanagerConfig:
        bearer = self.bearer_token_env or self.bearer_token_file
        basic = self.basic_auth_password_env or self.basic_auth_password_file
        if bearer and (basic or self.basic_auth_user):
            raise ValueError("choose bearer or basic auth, not both")
        if basic and not self.basic_auth_user:
            raise ValueError("basic_auth_user: required with a basic auth password")
        return self


class AlertingConfig(Strict):
    """How incidents reach the Alertmanagers (``monitor/paging/pager.py``)."""

    # Open incidents are re-sent this often, with endsAt four intervals ahead (Prometheus's rule).
    resend_interval_seconds: float = Field(60, ge=1, le=3600)
    # How often the outbox is checked when no incident change nudged it.
    poll_interval_seconds: float = Field(2, gt=0, le=60)
    timeout_seconds: float = Field(10, gt=0, le=120)
    # While no Alertmanager accepts, the wait between rounds doubles from poll_interval_seconds
    # up to this (with jitter); the first acceptance ends it.
    backoff_max_seconds: float = Field(60, gt=0, le=3600)
    # Where runbook links point; default: <api.public_url>/runbooks (the monitor serves alerts/runbooks).
    runbook_base_url: str | None = Field(None, max_length=2048)

    @field_validator("runbook_base_url")
    @classmethod
    def _runbooks(cls, v: str | None) -> str | None:
        return None if v is None else http_url(v)


_SUBJECT = r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$"
_NAME = r"^[A-Za-z0-9_-]+$"


class JetStreamConfig(Strict):
    """Gateway traffic read from NATS JetStream (``monitor/traffic/jetstream.py``), where the taps
    publish it (``KVCANARY_TAP_URL=nats://...``)."""

    url: str = Field("nats://127.0.0.1:4222", max_length=2048)
    # The stream this monitor creates (or updates) at start, on <subject_prefix>.0 to .<partitions - 1>.
    stream: str = Field("KVCANARY_TRAFFIC", pattern=_NAME, max_length=64)
    subject_prefix: str = Field("kvcanary.traffic", pattern=_SUBJECT, max_length=200)
    # Deployments are spread over this many partitions (the taps' KVCANARY_TAP_PARTITIONS: the same).
    partitions: int = Field(16, ge=1, le=1024)
    # The KV bucket where replicas share out the partitions (heartbeats and claims, 6 s leases).
    bucket: str = Field("kvcanary_partitions", pattern=_NAME, max_length=64)
    # The KV bucket the replicas put the quarantine set in, and the taps watch (docs/tap-protocol.md).
    quarantine_bucket: str = Field(QUARANTINE_BUCKET, pattern=_NAME, max_length=64)
    # How long the stream keeps a record not yet judged (a judged one leaves it: a work queue), so
    # one sent while every monitor was down is still judged, and in a blast radius, when they come
    # back; and the most it holds so (then taps keep theirs, bounded, and count drops).
    max_age_days: float = Field(7, gt=0, le=3650)
    max_bytes: int = Field(8 * 1024**3, ge=1024**2)
    # Copies of the stream in a NATS cluster (1: one server; 3: survives losing one).
    stream_replicas: int = Field(1, ge=1, le=5)
    # A resend of a record within this long is dropped by JetStream (Nats-Msg-Id); the monitor
    # remembers judged record ids twice as long, so a redelivery is never judged again.
    duplicate_window_seconds: float = Field(900, ge=10, le=DAY)
    # A record a replica took and did not acknowledge (it died) is delivered again after this long.
    ack_wait_seconds: float = Field(30, ge=1, le=3600)
    # Records of one partition out at once, unacknowledged (a few pulled batches).
    max_ack_pending: int = Field(1000, ge=1, le=100_000)
    token_env: EnvName = "KVCANARY_NATS_TOKEN"
    token_file: Path | None = None
    # The NATS user the monitor logs in as, its password the token above; none: the token alone.
    # A user of its own gives the monitors rights the taps lack (docs/nats-permissions.conf).
    user: str | None = Field(None, pattern=_NAME, max_length=64)
    # Live replicas past which the bucket's heartbeats are not believed: more is a writer forging them
    # (kvcanary_traffic_stream_bucket_anomalies{kind="replicas_over_limit"}).
    max_replicas: int = Field(64, ge=1, le=10_000)

    @field_validator("url")
    @classmethod
    def _nats_url(cls, v: str) -> str:
        if not re.match(r"^(nats|tls)://[^/\s]+$", v):
            raise ValueError("must be nats://HOST:PORT (or tls://HOST:PORT)")
        if "@" in v:  # a URL is logged and shown on /healthz, where a token never is
            raise ValueError("must not carry credentials; use token_env or token_file")
        return v

    @model_validator(mode="after")
    def _window_covers_redelivery(self) -> JetStreamConfig:
        if self.duplicate_window_seconds < 2 * self.ack_wait_seconds:
            raise ValueError(
                "duplicate_window_seconds: must be at least twice ack_wait_seconds (a redelivery "
                "comes ack_wait_seconds after a delivery and must find its record still remembered)"
            )
        return self


class TrafficConfig(Strict):
    """Gateway traffic (``POST /api/v1/traffic``, ``monitor/traffic/``)."""

    # How records are judged once: http, taken by POST /api/v1/traffic on a single replica (with
    # more than one live replica a post is refused with 503); jetstream, the stream of
    # traffic.jetstream, consumed by all replicas as one group, where POST publishes them too.
    source: Literal["http", "jetstream"] = "http"
    jetstream: JetStreamConfig = JetStreamConfig()
    # A token that may post traffic and read nothing; the API token may post too.
    ingest_token_env: EnvName = "KVCANARY_INGEST_TOKEN"
    ingest_token_file: Path | None = None
    overlap_window_seconds: float = Field(900, gt=0, le=DAY)
    # Fingerprints one deployment's window holds at most (about 270 bytes each in memory: 65 MB).
    overlap_max_fingerprints: int = Field(250_000, ge=1000, le=50_000_000)
    # Distinct callers holding a fingerprint that make it common (boilerplate): never a leak.
    overlap_common_callers: int = Field(3, ge=2, le=1000)
    # Consecutive fingerprints (each 8 words, one n-gram in four) of one other caller's prompt that
    # make a suspected leak: its private input, which a stale KV cache continues (about 24-48 words;
    # 4 catches a few more 40-word passages and flags a few more recited boilerplates: docs/detection.md).
    overlap_min_prompt_run: int = Field(5, ge=2, le=1024)
    # Consecutive fingerprints of anything another caller sent or was answered that make a suspected
    # leak; off by default: answers reciting public text (API docs, quotes, articles) to several
    # callers look the same (bench/detection.py: 231 false flags in 5,000 benign exchanges at 8).
    overlap_min_run: int | None = Field(None, ge=2, le=1024)
    # Distinctive tokens (names, figures, identifiers) of one other caller's prompt that make a
    # suspected leak however reworded (the reworded check; the window's age and bound are the
    # overlap window's); null turns the check off.
    reworded_min_tokens: int | None = Field(3, ge=2, le=256)
    # A check that only passed is recorded at most this often per (target, node): its resolve clock.
    pass_interval_seconds: float = Field(60, ge=0, le=DAY)

    def restart_keys(self, new: TrafficConfig) -> list[str]:
        """Return the keys of ``new`` that differ and that a running process cannot take up (the
        stream consumer is built on them), for a reload to refuse; ``jetstream`` only where it is
        read (a block unused before and after may change)."""
        keys = ["traffic.source"] if self.source != new.source else []
        if "jetstream" in (self.source, new.source) and self.jetstream != new.jetstream:
            keys.append("traffic.jetstream")
        return keys


class LogSourceConfig(Strict):
    """A gateway's log files (a glob, scanned in place by DuckDB) and their format."""

    path: str = Field(min_length=1, max_length=4096)
    format: Literal["auto", "litellm", "sglang", "openai"] = "auto"


class BlastRadiusConfig(Strict):
    """What a blast radius reads besides the traffic the monitor recorded (``monitor/blast/``)."""

    # Callers left out of every blast radius and counted apart: the reporter, internal test accounts.
    exclude_callers: list[str] = Field(default_factory=list, max_length=1000)
    logs: list[LogSourceConfig] = Field(default_factory=list, max_length=64)
    # LiteLLM's database (its LiteLLM_SpendLogs table), a URL with a password: env or file only.
    litellm_db_url_env: EnvName | None = None
    litellm_db_url_file: Path | None = None


class ContainmentSigningConfig(Strict):
    """How the monitors sign the quarantine set the gateways read (``monitor/containment/signing.py``):
    a tap takes only a set signed by a key it holds, so whoever else can write the bucket or answer
    in a monitor's place moves no gateway. The private key (``kvcanary containment keygen``) comes
    from ``key_file`` or the variable ``key_env``, never this file; it is required while any target's
    containment mode is ``quarantine`` or its admission guard is on."""

    key_env: EnvName = "KVCANARY_QUARANTINE_SIGNING_KEY"
    key_file: Path | None = None
    # Public keys besides this monitor's own whose sets are the monitors' (another replica's while
    # keys rotate): what the bucket may hold without being put back (docs/operating.md).
    public_keys_env: EnvName = "KVCANARY_QUARANTINE_PUBLIC_KEYS"
    public_keys_file: Path | None = None
    # A set expires this long after it was signed: a tap refuses one past it (a frozen set replayed),
    # and one starting while every monitor was away longer has no set to apply.
    expires_seconds: float = Field(3600, ge=10, le=30 * DAY)
    # The set is signed anew this often though it did not change, so a tap sees it move forward and
    # says when it stops (KVCANARY_TAP_QUARANTINE_STALE_SECONDS, several of these).
    renew_seconds: float = Field(60, ge=1, le=DAY)

    @model_validator(mode="after")
    def _renewed_before_expiry(self) -> ContainmentSigningConfig:
        if self.renew_seconds * 2 > self.expires_seconds:
            raise ValueError(
                "renew_seconds: at most half of expires_seconds (a set is renewed before it expires)"
            )
        return self


class OtelConfig(Strict):
    """Every verdict as an OpenTelemetry GenAI evaluation event (``gen_ai.evaluation.result``), sent
    over OTLP/HTTP to a collector (``monitor/otel.py``). Opt-in: no ``otel:``, nothing is sent."""

    # The collector's OTLP/HTTP address (http://collector:4318); /v1/logs is added unless the path
    # already names it. Never credentials in it: headers_env or headers_file carry them.
    endpoint: str = Field(max_length=2048)
    # Headers for every export (an API key, a tenant), as OTEL_EXPORTER_OTLP_HEADERS writes them:
    # name=value pairs separated by commas, values URL-encoded; from a variable or a file, never here.
    headers_env: EnvName | None = None
    headers_file: Path | None = None
    timeout_seconds: float = Field(10, gt=0, le=120)
    # Events waiting to be sent at most; past it a verdict's event is dropped and counted
    # (kvcanary_otel_events_dropped_total), never waited for: judging does not slow down.
    max_queue: int = Field(4096, ge=16, le=1_000_000)
    # Events sent in one request at most, and how long the first of a request waits for company.
    batch_size: int = Field(512, ge=1, le=10_000)
    flush_seconds: float = Field(1.0, gt=0, le=60)
    # The resource's service.name: how the collector and its backends name this monitor.
    service_name: str = Field("kvcanary", pattern=r"^[A-Za-z0-9_.-]{1,64}$")

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        if "@" in v.split("//", 1)[-1].split("/", 1)[0]:  # a URL is logged; headers never are
            raise ValueError("must not carry credentials; use headers_env or headers_file")
        url = http_url(v)
        path = url.split("//", 1)[1].partition("/")[2]
        return url if path.endswith("v1/logs") else url.rstrip("/") + "/v1/logs"

    @model_validator(mode="after")
    def _one_header_source(self) -> OtelConfig:
        if self.headers_env and self.headers_file:
            raise ValueError("choose headers_env or headers_file, not both")
        return self


class Settings(Strict):
    database_url: str = "sqlite:///kvcanary.db"
    api: ApiConfig = ApiConfig()
    targets: list[TargetConfig] = Field(default_factory=list)
    incidents: IncidentConfig = IncidentConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    retention: RetentionConfig = RetentionConfig()
    evidence: EvidenceConfig = EvidenceConfig()
    spool: SpoolConfig = SpoolConfig()
    limits: LimitsConfig = LimitsConfig()
    alertmanagers: list[AlertmanagerConfig] = Field(default_factory=list, max_length=16)
    alerting: AlertingConfig = AlertingConfig()
    traffic: TrafficConfig = TrafficConfig()
    blast_radius: BlastRadiusConfig = BlastRadiusConfig()
    containment: ContainmentPolicy = ContainmentPolicy()
    containment_signing: ContainmentSigningConfig = ContainmentSigningConfig()
    otel: OtelConfig | None = None
    marker_ttl_seconds: float = Field(6 * 3600, gt=0, le=30 * DAY)
    # The secret that seals markers, so replicas and a restarted monitor recognise each other's;
    # without one it is derived from the API token (see monitor/config/secrets.py: marker_key).
    marker_key_env: EnvName = "KVCANARY_MARKER_KEY"
    marker_key_file: Path | None = None
    _by_name: dict[str, TargetConfig] = PrivateAttr(default_factory=dict)

    @field_validator("database_url")
    @classmethod
    def _db(cls, v: str) -> str:
        if not re.match(r"^(sqlite|postgresql)(\+\w+)?://", v):
            raise ValueError("must be sqlite:///PATH or postgresql+psycopg://USER@HOST/DB")
        try:  # parsed now, so that a bad port exits 2 here, not as a traceback at connect time
            make_url(v).port  # noqa: B018
        except (ArgumentError, ValueError):
            raise ValueError("is not a database URL (check the host, the port and any escaping)") from None
        return v

    @model_validator(mode="after")
    def _unique_targets(self) -> Settings:
        names = [t.name for t in self.targets]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"targets: duplicate name(s) {dupes}")
        urls = [am.url for am in self.alertmanagers]
        if len(set(urls)) != len(urls):
            raise ValueError("alertmanagers: an Alertmanager is listed twice")
        return self

    def model_post_init(self, context: Any) -> None:
        self._by_name = {t.name: t for t in self.targets}

    def target(self, name: str) -> TargetConfig | None:
        """Return the target named ``name`` (a dict lookup: every probe run asks), or None."""
        return self._by_name.get(name)

    def containment_of(self, target: TargetConfig) -> ContainmentPolicy:
        """Return ``target``'s containment policy: the top-level one with what the target states."""
        stated = target.containment.model_dump(exclude_none=True)
        return self.containment.model_copy(update=stated) if stated else self.containment


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
        lines = error_lines(exc, top_level="(top level)")[:5]
        raise ConfigError(f"{source}: " + "; ".join(lines)) from None


def load_settings(path: str | Path) -> Settings:
    """Read and validate the YAML file at ``path``; raise ConfigError naming the key at fault.

    A mapping key given twice, at any depth, is refused naming its path and both lines: plain YAML
    would keep the last one silently, and the first may be the one the operator meant.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    try:
        data = load_yaml(text)
    except DuplicateKeyError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_settings(data, source=str(path))
