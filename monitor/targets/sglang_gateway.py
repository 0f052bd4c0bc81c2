"""A target's nodes as SGLang's model gateway lists them: ``GET /workers``, one node per worker.

The gateway (``sglang-router``, the SGLang Model Gateway) knows every prefill, decode or regular
worker it routes to, and ``POST /workers`` and ``DELETE /workers/{id}`` change that set while it
runs. Its answer (``tests/fixtures/engines/sglang-router-0.3.2-pd-workers.json``, recorded) is
``{"workers": [{"id", "url", "worker_type", "is_healthy", "bootstrap_port", "metadata", ...}],
"total", "stats"}``. Each worker becomes a :class:`NodeConfig` the monitor audits on its own.

What the gateway writes is read like an engine's answer: bounded in size (``Limits.lookup_bytes``),
at most :data:`MAX_WORKERS` workers, and each name made from the role and the URL's host and port
only, so that nothing it sends reaches a metric label or a log line raw. A worker whose type is not
one of :data:`ROLES`, or whose URL no engine can have (:func:`worker_url`: http or https, a host
DNS could resolve or an IP literal, a port in range, at most :data:`MAX_URL_CHARS` characters), is
left out and counted by why, never guessed at; one worker that cannot be read costs the listing
nothing else. Every node made here is marked ``discovered``: its address is the gateway's word,
not the operator's, and no credential goes there unless the target's credential scope covers it
(``monitor/config/credentials.py``). Nothing here sends a credential: the gateway and its nodes
are read without one.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import ipaddress
import json
import re
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvcanary.monitor.config.base import http_url
from kvcanary.monitor.config.targets import NodeConfig
from kvcanary.monitor.targets.http import CONNECT_ERRORS, HttpClient, chunks
from kvcanary.monitor.targets.openai_format import Limits, read_limited

#: Workers kept from one answer: a gateway listing more is cut here (as ``nodes:`` is, at 1,000).
MAX_WORKERS = 1000
#: The longest worker URL taken: a scheme, a host of at most 253 characters, a port and a short
#: path prefix fit many times over; a longer one names no engine (and its ``/metrics`` URL must
#: stay within a node's 2,048).
MAX_URL_CHARS = 512
#: What DNS resolves: a name of at most 253 characters in labels of 1 to 63 letters, digits,
#: hyphens (and the underscores some internal zones use). A longer host is no machine's, and
#: aiohttp's URL encoding raises on it: reading such a node would fail with no error a read expects.
MAX_HOST_CHARS = 253
_LABEL = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")
#: Why a listed worker is not taken as a node: ``type`` (no worker type kvcanary knows), ``url``
#: (a URL no engine can have), ``cut`` (past :data:`MAX_WORKERS`), ``unreadable`` (anything else).
REFUSALS_BY = ("type", "url", "cut", "unreadable", "claimed")
#: The gateway's worker types as node roles; ``regular`` is an aggregated (non-PD) worker.
ROLES = {"prefill": "prefill", "decode": "decode", "regular": "aggregated"}
#: A data-parallel-aware gateway lists each rank as ``URL@rank``: the ranks share one server.
_DP_RANK = re.compile(r"@\d+$")
_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9_.-]+")
_NAME_CHARS = 63


class GatewayUnreadable(Exception):
    """The gateway's worker list could not be read; ``str()`` says why, in words fit for a log."""


class NodeUnreadable(Exception):
    """A node gave no answer to a question asked when it joins (no answer in time, no connection,
    or an answer that is not what it claims); ``str()`` says why, in words fit for a log."""


@dataclass
class WorkerList:
    """The nodes one answer lists, and the workers it named that could not be taken as nodes, by
    why (:data:`REFUSALS_BY`)."""

    nodes: list[NodeConfig] = field(default_factory=list)
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    #: What the gateway says of each node's health (``is_healthy``), by node name: a node it
    #: thinks healthy gets customers, whatever kvcanary's probes found there.
    healthy: dict[str, bool] = field(default_factory=dict)
    #: A short, plain excerpt of the first refused worker's URL, for the log line that says so.
    example: str = ""

    @property
    def skipped(self) -> int:
        """Return how many listed workers were not taken as nodes, whatever the reason."""
        return sum(self.refused.values())


def node_name(role: str, url: str) -> str:
    """Return a stable node name for a worker: its role, host and port (``prefill-10.0.0.7-30000``).

    The same worker gets the same name at every reading and on every replica, so its results, its
    state and its metrics stay one series while it is listed. Where the plain name loses part of
    the URL (an IPv6 address's colons, a letter outside ASCII, a path, the scheme when it is https)
    or is longer than a node name may be, it keeps a short hash of the whole URL: two workers never
    meet in one name, and the second is never taken for the first listed twice.
    """
    parsed = httpx.URL(url)
    port = parsed.port or {"http": 80, "https": 443}.get(parsed.scheme, 0)
    plain = f"{role}-{parsed.host}-{port}"
    name = _NOT_IN_NAME.sub("_", plain).strip("_.-") or role
    lossy = name != plain or parsed.path.strip("/") != "" or parsed.scheme != "http"
    if lossy or len(name) > _NAME_CHARS:
        digest = hashlib.blake2b(f"{role} {url}".encode(), digest_size=4).hexdigest()
        name = f"{name[: _NAME_CHARS - 9].rstrip('_.-')}-{digest}"
    return name


def worker_url(raw: str) -> str | None:
    """Return ``raw`` (a data-parallel rank's ``@rank`` removed) as a node's URL, or None when no
    engine can be at it: not http or https, credentials, a query or fragment (``http_url``), a
    host DNS cannot resolve (:data:`MAX_HOST_CHARS`) that is no IP literal, a port out of range,
    or longer than :data:`MAX_URL_CHARS`."""
    if len(raw) > MAX_URL_CHARS:
        return None
    try:
        url = http_url(_DP_RANK.sub("", raw))
        host = httpx.URL(url).raw_host.decode("ascii")  # a name IDNA-encoded, as DNS is asked
    except (ValueError, UnicodeDecodeError):  # httpx.InvalidURL is a ValueError
        return None
    return url if _resolvable(host) else None


def _resolvable(host: str) -> bool:
    """Return whether ``host`` is an IP address or a name DNS could resolve."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    return 0 < len(host) <= MAX_HOST_CHARS and all(_LABEL.match(label) for label in labels)


def worker_node(worker: Any) -> NodeConfig | None:
    """Return the node of one listed worker, or None when its type or URL cannot be read."""
    node, _ = _worker_node(worker)
    return node


def _worker_node(worker: Any) -> tuple[NodeConfig | None, str]:
    """Return the node of one listed worker, or None and why not (:data:`REFUSALS_BY`)."""
    if not isinstance(worker, dict):
        return None, "unreadable"
    kind = worker.get("worker_type")
    role = ROLES.get(kind) if isinstance(kind, str) else None
    if role is None:
        return None, "type"
    raw_url = worker.get("url")
    url = worker_url(raw_url) if isinstance(raw_url, str) else None
    if url is None:
        return None, "url"
    port = worker.get("bootstrap_port")
    bootstrap = port if role == "prefill" and type(port) is int and 0 < port < 65536 else None
    node = NodeConfig(
        name=node_name(role, url),
        role=role,
        info_url=url,
        metrics_url=f"{url}/metrics",
        bootstrap_port=bootstrap,
    )
    # Marked after validation, which refuses the mark from a file: only a gateway's listing has it.
    return node.model_copy(update={"discovered": True}), ""


def parse_workers(payload: Any) -> WorkerList:
    """Return the nodes a ``GET /workers`` answer lists; raise :class:`GatewayUnreadable` when the
    answer is not a worker list at all (an empty list is an answer: the gateway routes to nobody).
    A worker that cannot be taken as a node is counted in ``refused`` and costs the others nothing."""
    workers = payload.get("workers") if isinstance(payload, dict) else None
    if not isinstance(workers, list):
        raise GatewayUnreadable("the answer has no 'workers' list")
    found = WorkerList()
    if len(workers) > MAX_WORKERS:
        found.refused["cut"] = len(workers) - MAX_WORKERS
    names: set[str] = set()
    ranks: dict[str, int] = {}  # the most ranks a node's ``URL@rank`` listings show
    for worker in workers[:MAX_WORKERS]:
        try:
            node, why = _worker_node(worker)
        except Exception:  # whatever one worker's fields make of validation: that worker only
            node, why = None, "unreadable"
        if node is None:
            if not found.refused:
                found.example = _excerpt(worker)
            found.refused[why] += 1
            continue
        if (rank := _DP_RANK.search(worker["url"])) is not None and int(rank.group()[1:]) < 64:
            ranks[node.name] = max(ranks.get(node.name, 1), int(rank.group()[1:]) + 1)
        if node.name not in names:  # ranks of one server, or one server listed twice: one node
            names.add(node.name)
            found.nodes.append(node)
            if isinstance(healthy := worker.get("is_healthy"), bool):
                found.healthy[node.name] = healthy
        elif worker.get("is_healthy") is False:  # one rank unhealthy: the server is not all healthy
            found.healthy[node.name] = False
    found.nodes = [node.model_copy(update={"dp_size": ranks.get(node.name, 1)}) for node in found.nodes]
    return found


def _excerpt(worker: Any) -> str:
    """Return the first characters of a refused worker's URL, made plain (it reaches a log line)."""
    url = worker.get("url") if isinstance(worker, dict) else None
    if not isinstance(url, str):
        return ""
    plain = _NOT_IN_NAME.sub("_", url[:48])
    return f"{plain}... ({len(url)} characters)" if len(url) > 48 else plain


async def _get(http: HttpClient, url: str, timeout: float, limits: Limits) -> tuple[int, str, bool]:
    """GET ``url``: its status, its body up to ``limits.lookup_bytes``, and whether that is all of it."""
    async with asyncio.timeout(timeout):
        session = await http.session()
        async with session.get(url, allow_redirects=False) as response:
            raw, complete = await read_limited(chunks(response), limits.lookup_bytes, response.content_length)
            return response.status, raw, complete


async def read_dp_size(http: HttpClient, node: NodeConfig, timeout: float, limits: Limits) -> int:
    """Return the data-parallel ranks a node's server info states (``dp_size``; ``/server_info``,
    else ``/get_server_info``), or 1 where the node answers without saying (a gateway that is not
    DP-aware lists each server once, whatever ranks it runs); raise :class:`NodeUnreadable` where it
    gives no answer, or a 200 that is not a JSON object within ``limits``."""
    for path in ("/server_info", "/get_server_info"):
        url = f"{node.info_url}{path}"
        status, raw, complete = await _node_get(http, url, timeout, limits)
        if status == 404:
            continue
        if status != 200:  # an answer that says nothing of ranks (one wanting a key, say)
            return 1
        try:
            info = json.loads(raw) if complete else None
        except ValueError:
            info = None
        if not isinstance(info, dict):
            raise NodeUnreadable(f"{path}: {'too large' if not complete else 'not a JSON object'}")
        size = info.get("dp_size")
        return size if type(size) is int and 1 <= size <= 64 else 1
    return 1


async def _node_get(http: HttpClient, url: str, timeout: float, limits: Limits) -> tuple[int, str, bool]:
    """:func:`_get` of a node's page; raise :class:`NodeUnreadable` where no answer comes."""
    try:
        return await _get(http, url, timeout, limits)
    except TimeoutError:
        raise NodeUnreadable(f"no answer within {timeout:g}s") from None
    except CONNECT_ERRORS:
        raise NodeUnreadable("cannot connect") from None
    except aiohttp.ClientError as exc:
        raise NodeUnreadable(type(exc).__name__) from None


#: What a node answers a request without a credential with when it wants one.
REFUSALS = frozenset({401, 403})


async def refuses_without_key(http: HttpClient, node: NodeConfig, timeout: float, limits: Limits) -> bool:
    """Return whether a node refuses a request that carries no credential: ``GET /v1/models`` (which
    SGLang, vLLM and the reference worker guard whenever they take keys) answered 401 or 403. Any
    other answer is no refusal: the node is probed without a key, and what its probes meet is
    theirs to say. Raise :class:`NodeUnreadable` where no answer comes (taken as no refusal)."""
    status, _, _ = await _node_get(http, f"{node.info_url}/v1/models", timeout, limits)
    return status in REFUSALS


async def read_workers(http: HttpClient, gateway: str, timeout: float, limits: Limits) -> WorkerList:
    """Return the nodes the gateway at ``gateway`` lists now; raise :class:`GatewayUnreadable`."""
    url = f"{gateway}/workers"
    try:
        status, raw, complete = await _get(http, url, timeout, limits)
    except TimeoutError:
        raise GatewayUnreadable(f"{url}: no answer within {timeout:g}s") from None
    except CONNECT_ERRORS as exc:
        raise GatewayUnreadable(f"{url}: cannot connect ({exc})") from None
    except aiohttp.ClientError as exc:
        raise GatewayUnreadable(f"{url}: {type(exc).__name__}") from None
    if status != 200:
        raise GatewayUnreadable(f"{url}: HTTP {status}")
    if not complete:
        raise GatewayUnreadable(f"{url}: the answer is larger than {limits.lookup_bytes} bytes")
    try:
        return parse_workers(json.loads(raw))
    except ValueError:
        raise GatewayUnreadable(f"{url}: the answer is not JSON") from None
    except GatewayUnreadable as exc:
        raise GatewayUnreadable(f"{url}: {exc}") from None


#: The gateway's circuit breaker per worker, on its metrics port (sglang-router 0.3.2's
#: ``describe_gauge``: 0 closed, 1 open, 2 half-open), labelled by the worker's URL.
CIRCUIT_STATE = "smg_worker_cb_state"
#: Worse first: an open breaker sends a node nothing, a half-open one a trial request.
_CIRCUIT_WORSE = {1: 2, 2: 1, 0: 0}


async def read_circuits(
    http: HttpClient, metrics_url: str, nodes: list[NodeConfig], timeout: float, limits: Limits
) -> dict[str, int]:
    """Return the gateway's circuit-breaker state of each of ``nodes`` it has one for, by node name
    (a node with ranks: its worst rank's), from the page at ``metrics_url``; raise
    :class:`GatewayUnreadable`."""
    try:
        status, raw, complete = await _get(http, metrics_url, timeout, limits)
    except (TimeoutError, aiohttp.ClientError, *CONNECT_ERRORS) as exc:
        raise GatewayUnreadable(f"{metrics_url}: {type(exc).__name__}") from None
    if status != 200 or not complete:
        raise GatewayUnreadable(
            f"{metrics_url}: HTTP {status}" if status != 200 else f"{metrics_url}: too large"
        )
    by_url = {node.info_url: node.name for node in nodes}
    states: dict[str, int] = {}
    try:
        for family in text_string_to_metric_families(raw):
            for sample in family.samples:
                worker = sample.labels.get("worker", "") if sample.name == CIRCUIT_STATE else ""
                name = by_url.get(_worker_url(worker)) if worker else None
                state = int(sample.value) if sample.value in (0, 1, 2) else None
                if name is not None and state is not None:
                    states[name] = max(states.get(name, 0), state, key=_CIRCUIT_WORSE.__getitem__)
    except Exception as exc:  # the parser's own assorted errors: the page is not one it reads
        # Its type only: the parser's messages quote the page, and what a gateway wrote reaches no log.
        raise GatewayUnreadable(f"{metrics_url}: not a Prometheus page ({type(exc).__name__})") from None
    return states


def _worker_url(label: str) -> str:
    try:
        return http_url(_DP_RANK.sub("", label))
    except ValueError:
        return ""
