"""The part of the settings that describes what is probed: targets, their tenants and nodes.

:mod:`monitor.config.base` holds what every settings model shares, :mod:`.containment_policy` what a
leak does to routing; :mod:`monitor.config.settings` assembles the whole ``Settings``.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
from pydantic import (
    AfterValidator,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvcanary.monitor.config.base import DAY, EnvName, Name, Strict, http_url
from kvcanary.monitor.config.containment_policy import TargetContainment
from kvcanary.monitor.config.credentials import CredentialScope, parse_host_rule
from kvcanary.probes import REGISTRY
from kvcanary.probes.target import Node, ServingPath, ranked_name
from kvcanary.probes.yamlfile import key_path

log = logging.getLogger(__name__)

Engine = Literal["sglang", "vllm", "llamacpp", "reference", "openai"]

#: What a target that states no ``probes`` runs: three kinds that judge answers, and, on an engine
#: that publishes its pools, version and counters (every one but a hosted API), the three audits that
#: read them and send no request.
DEFAULT_PROBES = ("canary", "cross_tenant", "boundary")
AUDITS = ("capacity", "version", "counters")
AUDITED_ENGINES = frozenset({"sglang", "vllm", "llamacpp", "reference"})
#: What ``path_probes`` is by default: the canary and the admission boundary judge one pair's
#: hand-off and its decode pages; the other kinds judge what no pair changes.
PATH_KINDS = ("canary", "boundary")
#: Paths a target has at most (16 prefill x 16 decode): each costs its kinds' runs every interval.
MAX_PATHS = 256


def path_name(prefill: str, decode: str) -> str:
    """Return the name of the path (prefill, decode) as a node name (``NAME_RE``, at most 63
    characters): both names joined by ``--``, cut with a hash of the whole where too long."""
    name = f"{prefill}--{decode}"
    if len(name) <= 63:
        return name
    digest = hashlib.blake2b(name.encode(), digest_size=4).hexdigest()
    half = (63 - 12) // 2
    return f"{prefill[:half]}--{decode[:half]}-{digest}"


def _host_entry(value: str) -> str:
    parse_host_rule(value)  # raises ValueError saying what is wrong
    return value.strip()


#: A ``credential_hosts`` entry (``monitor/config/credentials.py``, ``parse_host_rule``).
HostEntry = Annotated[str, AfterValidator(_host_entry)]


class TenantConfig(Strict):
    name: Name
    api_key_env: EnvName | None = None
    api_key_file: Path | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_literal_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "api_key" in data:
            raise ValueError("api_key: literal keys are refused; use api_key_env or api_key_file")
        return data


class NodeConfig(Strict):
    """One serving node of a target: a disaggregated deployment has prefill and decode nodes, each
    with its own pool, server info and metrics. Node-scoped probes (``counters``) judge each alone."""

    name: Name
    role: Literal["aggregated", "prefill", "decode"] = "aggregated"
    # The node's own API (server info, tokenizer); default: the target's base_url.
    info_url: str | None = Field(None, max_length=2048)
    # Its Prometheus endpoint; default: <info_url>/metrics.
    metrics_url: str | None = Field(None, max_length=2048)
    # A prefill node's K/V hand-off port (SGLang's --disaggregation-bootstrap-port; the gateway lists
    # it): with it, each prefill x decode pair of the target is probed as a path of its own.
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    # Its data-parallel ranks (SGLang's --dp-size): each rank of a prefill or decode node is a path
    # of its own. The gateway's listing or the node's server info says it for found nodes.
    dp_size: int = Field(1, ge=1, le=64)
    # A Prometheus page made from the node's log, read by ``counters`` beside metrics_url: mtail
    # running alerts/mtail/sglang_kv_canary.mtail on an SGLang log (its own KV canary only logs).
    # Default: the target's log_metrics_port on the node's host, else none.
    log_metrics_url: str | None = Field(None, max_length=2048)
    # Set by the monitor on the nodes an SGLang gateway lists, never in a file (refused there): such
    # a node's address is the gateway's word, so it is in the target's credential scope only where
    # credential_hosts cover it (monitor/config/credentials.py); and whether it refused a request
    # without a credential when it joined (outside the scope, its pairs are then not probed).
    discovered: bool = False
    refuses_without_key: bool = False

    @model_validator(mode="before")
    @classmethod
    def _not_from_a_file(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in ("discovered", "refuses_without_key"):
                if key in data:
                    raise ValueError(f"{key}: the monitor sets it on the nodes a gateway lists, not a file")
        return data

    @field_validator("role", mode="before")
    @classmethod
    def _deprecated_role(cls, v: object) -> object:
        # "single" is 0.1's name for the aggregated role: read as it, with a warning, until 0.3 refuses
        # it, so a file written for 0.1 keeps loading (CHANGELOG.md, "Upgrading from 0.1").
        if v == "single":
            log.warning("nodes: role 'single' is deprecated and will be refused in 0.3: write 'aggregated'")
            return "aggregated"
        return v

    @field_validator("info_url", "metrics_url", "log_metrics_url")
    @classmethod
    def _urls(cls, v: str | None) -> str | None:
        return None if v is None else http_url(v)


class TargetConfig(Strict):
    name: Name
    base_url: str = Field(max_length=2048)
    engine: Engine = "reference"
    model: str = Field("default", min_length=1, max_length=255)
    tenants: list[TenantConfig] = Field(min_length=1)
    interval_seconds: float = Field(30.0, gt=0, le=7 * DAY)
    timeout_seconds: float = Field(30.0, gt=0, le=3600)
    # Unstated: DEFAULT_PROBES, and AUDITS where the engine publishes what they read (_default_probes).
    probes: list[str] = Field(default_factory=lambda: list(DEFAULT_PROBES), min_length=1)
    # Per-kind interval override. Without one a kind runs at interval_seconds, or at its own default
    # when that is longer: large or costly kinds (boundary, version, needle, prefix_cache) run less often.
    probe_intervals: dict[str, float] = Field(default_factory=dict)
    # Per-kind options handed to the probe (e.g. boundary: {max_prompt_tokens: 2000000}).
    options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # The serving nodes behind base_url; none listed: one node at base_url.
    nodes: list[NodeConfig] = Field(default_factory=list, max_length=1000)
    # The api_base a gateway names this target by, where it is not base_url or a node's URL
    # (a load balancer's address, say): gateway traffic records to it are this target's.
    gateway_api_bases: list[str] = Field(default_factory=list, max_length=100)
    # SGLang's model gateway in front of the nodes (base_url may be the gateway itself): its
    # ``GET /workers`` lists the nodes, read every discovery_interval_seconds and merged after the
    # listed ``nodes:`` (a listed name wins). Until the gateway first answers, the target has the
    # listed nodes only: the gateway is no engine, and auditing it as one would judge nothing real.
    sglang_router: str | None = Field(None, max_length=2048)
    # The gateway's own metrics page (its --prometheus-port): its circuit breaker per worker is read
    # there at each discovery, as kvcanary_gateway_worker_circuit_state by node.
    sglang_router_metrics: str | None = Field(None, max_length=2048)
    discovery_interval_seconds: float = Field(15.0, gt=0, le=DAY)
    # Where each node's log exporter listens on the node's own host (mtail's 3903, say), for nodes
    # that name no log_metrics_url: the nodes a gateway lists included.
    log_metrics_port: int | None = Field(None, ge=1, le=65535)
    # Kinds also sent down every prefill x decode pair itself, as the gateway would send them
    # (``paths()``; a target with no prefill node that states its bootstrap port has none): each
    # pair is judged once per interval of the kind, whatever the gateway's policy picks.
    path_probes: list[str] = Field(default_factory=lambda: list(PATH_KINDS), max_length=len(REGISTRY))
    # This target's containment policy where it differs from the top-level one.
    containment: TargetContainment = TargetContainment()
    # Where the tenants' keys (or the worker credential) may go besides base_url's origin and the
    # URLs this file writes for its nodes: ``host`` (any port), ``host:port``, ``[v6]:port``, a
    # CIDR (addresses written in a URL) or a DNS suffix (``.svc.cluster.local``: names under it).
    # A node the gateway lists outside them is sent no credential (monitor/config/credentials.py).
    credential_hosts: list[HostEntry] = Field(default_factory=list, max_length=256)
    # A credential the workers behind the gateway take, sent in place of the tenants' keys to every
    # origin in scope but base_url's; read like a tenant's key, never logged, stored or returned.
    worker_api_key_env: EnvName | None = None
    worker_api_key_file: Path | None = None

    @model_validator(mode="before")
    @classmethod
    def _default_probes(cls, data: Any) -> Any:
        """A target that states no ``probes`` gets the canary kinds, and the audits that send no
        request where its engine publishes what they read: given only a URL, the monitor compares
        every node's pool with its window (the audit that would have caught the incident)."""
        if isinstance(data, dict) and "probes" not in data:
            audits = AUDITS if data.get("engine", "reference") in AUDITED_ENGINES else ()
            return {**data, "probes": [*DEFAULT_PROBES, *audits]}
        return data

    @model_validator(mode="before")
    @classmethod
    def _no_literal_worker_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and "worker_api_key" in data:
            raise ValueError(
                "worker_api_key: literal keys are refused; use worker_api_key_env or worker_api_key_file"
            )
        return data

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        """Accept ``http(s)://host[:port][/prefix]``; a trailing ``/v1`` is dropped (paths add it)."""
        return http_url(v).removesuffix("/v1").rstrip("/")

    @field_validator("sglang_router", "sglang_router_metrics")
    @classmethod
    def _router(cls, v: str | None) -> str | None:
        return None if v is None else http_url(v)

    @field_validator("gateway_api_bases")
    @classmethod
    def _bases(cls, v: list[str]) -> list[str]:
        return [http_url(url).removesuffix("/v1").rstrip("/") for url in v]

    @field_validator("probes")
    @classmethod
    def _known_probes(cls, v: list[str]) -> list[str]:
        unknown = [p for p in v if p not in REGISTRY]
        if unknown:
            raise ValueError(f"unknown probe kind(s) {unknown}; known: {sorted(REGISTRY)}")
        if len(set(v)) != len(v):
            raise ValueError("lists a probe kind twice")
        return v

    @field_validator("path_probes")
    @classmethod
    def _path_probes(cls, v: list[str]) -> list[str]:
        wrong = [p for p in v if p not in REGISTRY or REGISTRY[p].scope != "target"]
        if wrong:
            raise ValueError(f"{wrong}: only kinds that judge the serving path run down a pair")
        return list(dict.fromkeys(v))

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
                # The first problem only, worded as pydantic words it: it becomes one line of the
                # outer error (``targets[0].options: boundary.max_prompt_tokens: ...``).
                err = exc.errors()[0]
                where = key_path((kind, *err["loc"]), dotted_indices=True)
                raise ValueError(f"{where}: {err['msg']}") from None
            checked[kind] = model.model_dump(exclude_unset=True)
        return checked

    @model_validator(mode="after")
    def _tenants(self) -> TargetConfig:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError("tenants: names must be unique")
        _no_shared_key_source(self.tenants)
        _worker_key_apart(self)
        nodes = [n.name for n in self.nodes]
        if len(set(nodes)) != len(nodes):
            raise ValueError("nodes: names must be unique")
        for kind in self.probes:
            needed = REGISTRY[kind].min_tenants
            if len(self.tenants) < needed:
                raise ValueError(f"tenants: the {kind} probe needs {needed} or more tenants")
        return self

    def interval_for(self, kind: str) -> float:
        """Return the seconds between runs of ``kind``: stated, else the longer of both defaults."""
        if kind in self.probe_intervals:
            return float(self.probe_intervals[kind])
        own = REGISTRY[kind].default_interval_seconds
        return max(float(self.interval_seconds), own) if own is not None else float(self.interval_seconds)

    def path_kinds(self) -> list[str]:
        """Return the kinds this target runs down each of its paths: ``path_probes`` it runs at all."""
        return [kind for kind in self.path_probes if kind in self.probes]

    def credential_scope(self) -> CredentialScope:
        """Return where this target's credentials may go: base_url's origin, the origins of the URLs
        the file writes for its nodes (never a node the gateway listed), and ``credential_hosts``."""
        named = [
            url
            for node in self.nodes
            if not node.discovered
            for url in (node.info_url, node.metrics_url, node.log_metrics_url)
            if url is not None
        ]
        return CredentialScope(self.base_url, named, self.credential_hosts)

    def shut_out(self) -> set[str]:
        """Return the names of the nodes no probe can go down: listed by the gateway outside the
        credential scope (so sent no credential), they refused a request without one."""
        refusing = [node for node in self.nodes if node.discovered and node.refuses_without_key]
        if not refusing:
            return set()
        scope = self.credential_scope()
        return {node.name for node in refusing if not scope.allows(node.info_url or self.base_url)}

    def paths(self) -> list[ServingPath]:
        """Return every (prefill, decode) pair of the target's nodes, at most ``MAX_PATHS``: prefill
        nodes whose bootstrap port is known (the gateway lists it) times decode nodes, neither of
        them :meth:`shut_out`. The pairs left out are counted by :meth:`unprobed_paths`."""
        nodes = self.node_list()
        shut = self.shut_out()
        prefills = [
            n for n in nodes if n.role == "prefill" and n.bootstrap_port is not None and n.name not in shut
        ]
        decodes = [n for n in nodes if n.role == "decode" and n.name not in shut]
        pairs = [
            ServingPath(p, d, path_name(ranked_name(p.name, pr), ranked_name(d.name, dr)), pr, dr)
            for p in prefills
            for pr in _ranks(p)
            for d in decodes
            for dr in _ranks(d)
        ]
        return pairs[:MAX_PATHS]

    def unprobed_paths(self) -> dict[str, int]:
        """Return how many (rank) pairs of the target's nodes no run goes down, by why: a prefill
        node whose bootstrap port is unknown (a request cannot be sent the gateway's way); on a
        gateway target, a node :meth:`shut_out` (``credential_out_of_scope``); or past
        ``MAX_PATHS``. The gateway may still send customers down them. Empty where the target
        probes no pair at all: no gateway named and no prefill node's bootstrap port stated (a
        file's way to leave its pairs to the probes sent through the gateway)."""
        nodes = self.node_list()
        shut = self.shut_out()
        decode_ranks = sum(len(_ranks(n)) for n in nodes if n.role == "decode")
        open_decodes = sum(len(_ranks(n)) for n in nodes if n.role == "decode" and n.name not in shut)
        prefills = [n for n in nodes if n.role == "prefill"]
        known = [n for n in prefills if n.bootstrap_port is not None]
        open_known = sum(len(_ranks(n)) for n in known if n.name not in shut)
        shut_known = sum(len(_ranks(n)) for n in known if n.name in shut)
        blind = sum(len(_ranks(n)) for n in prefills if n.bootstrap_port is None)
        probing = bool(known) or self.sglang_router is not None
        if not (prefills and decode_ranks and probing):
            return {}
        counts = {
            "no_bootstrap_port": blind * decode_ranks,
            "over_max_paths": max(0, open_known * open_decodes - MAX_PATHS),
        }
        if self.sglang_router is not None:  # only a gateway lists nodes outside the scope
            counts["credential_out_of_scope"] = shut_known * decode_ranks + open_known * (
                decode_ranks - open_decodes
            )
        return counts

    def node_list(self) -> list[Node]:
        """Return the target's nodes with every URL filled in; one unnamed node at base_url by default
        (none for a target whose nodes come from its SGLang gateway, until the gateway lists them)."""
        if not self.nodes and self.sglang_router is not None:
            return []
        if not self.nodes:
            logs = self._log_metrics_at(self.base_url)
            return [Node("", "aggregated", self.base_url, f"{self.base_url}/metrics", log_metrics_url=logs)]
        out = []
        for node in self.nodes:
            info = node.info_url or self.base_url
            metrics = node.metrics_url or f"{info}/metrics"
            logs = node.log_metrics_url or self._log_metrics_at(info)
            out.append(Node(node.name, node.role, info, metrics, node.bootstrap_port, node.dp_size, logs))
        return out

    def _log_metrics_at(self, info_url: str) -> str | None:
        """Return the log exporter's page on the host of ``info_url`` (None without a port)."""
        if self.log_metrics_port is None:
            return None
        url = httpx.URL(info_url)
        return str(url.copy_with(scheme="http", port=self.log_metrics_port, path="/metrics"))


def _ranks(node: Node) -> list[int | None]:
    """Return a node's data-parallel ranks as paths name them: None alone where it has one."""
    return [None] if node.dp_size == 1 else list(range(node.dp_size))


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


def _worker_key_apart(target: TargetConfig) -> None:
    """Refuse a worker credential read from a tenant's variable or file: it would be that tenant's
    key, sent where only the worker credential may go."""
    for tenant in target.tenants:
        for key, mine, theirs in (
            ("worker_api_key_env", target.worker_api_key_env, tenant.api_key_env),
            ("worker_api_key_file", target.worker_api_key_file, tenant.api_key_file),
        ):
            if mine is not None and str(mine) == str(theirs):
                raise ValueError(
                    f"{key}: tenant {tenant.name}'s key comes from {mine}; workers need their own"
                )


def _known(kinds: dict[str, Any]) -> None:
    unknown = [p for p in kinds if p not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown probe kind(s) {unknown}; known: {sorted(REGISTRY)}")
