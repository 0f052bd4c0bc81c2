"""How a probe reaches a target: the requests it sends, what comes back, and the client protocol.

``monitor/targets`` implements :class:`TargetClient` over HTTP; probes see only these types, so
the monitor and the serving engines meet in one place (``probes/base.py`` has the probe side).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

#: Statuses with which engines refuse a request they will not serve (SGLang, vLLM, llama.cpp: 400).
REFUSAL_STATUSES = frozenset({400, 413, 422})


@dataclass
class CompletionRequest:
    """One request to the serving path. ``chat`` selects /v1/chat/completions over /v1/completions."""

    prompt: str
    max_tokens: int = 32
    chat: bool = True
    stream: bool = True
    temperature: float = 0.0
    seed: int | None = 0
    system: str | None = None
    #: Earlier turns of a conversation, ``(role, content)`` pairs between the system message and
    #: ``prompt`` (a raw completion joins them before the prompt, one per line).
    history: tuple[tuple[str, str], ...] = ()
    #: vLLM's per-request prefix-cache salt (sent only when set): same salt shares, different does not.
    cache_salt: str | None = None
    #: A client request id (sent only when set): as ``X-Request-Id``, the body's ``user`` and, to
    #: engines that take one (SGLang, the reference worker), SGLang's ``rid``.
    request_id: str | None = None
    #: The model to ask for, when not the target's own: a LoRA adapter the target lists.
    model: str | None = None
    #: Hang up as a client that went away: after this many stream chunks (0: once the response's
    #: headers came, before any of its body), or after this many seconds whatever came by then.
    #: The completion's ``error_kind`` is then ``hung_up``, with what was read before.
    hang_up_after_chunks: int | None = None
    hang_up_after_seconds: float | None = None
    #: More body fields for engines that take them (``repetition_penalty``, ``stop``, ``n``).
    extra: dict[str, Any] = field(default_factory=dict)
    #: More headers, as a gateway in front of the engine would set them (a cache salt by header:
    #: NVIDIA Dynamo's ``x-tenant-id``); never a credential.
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Completion:
    """What came back. ``status`` is None when no HTTP response arrived (``error`` says why).

    ``text`` is the generated text, or the error body for a non-2xx answer (scanned for markers too:
    an error body is output a tenant sees). ``error_kind`` is ``connect``, ``timeout``, ``protocol``,
    ``stream`` (the engine reported an error inside a 200 stream), ``http`` (a non-2xx with an
    engine's error body) or ``foreign`` (a non-2xx whose body is no engine's: a proxy, a redirect)
    when something went wrong.
    """

    status: int | None
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    latency_seconds: float | None = None
    ttft_seconds: float | None = None
    error: str | None = None
    error_kind: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def refused(self) -> bool:
        """Return True when the ENGINE refused the request: 400, 413 or 422 with an engine-shaped
        error body (``error_kind == "http"``). A proxy's 413 page or a redirect is not a refusal."""
        return self.status in REFUSAL_STATUSES and self.error_kind == "http"

    @property
    def answered(self) -> bool:
        """Return True for a complete 2xx answer (no broken stream, no timeout after the headers)."""
        return self.ok and self.error_kind is None


@dataclass
class ServerCapacity:
    """What a node says about its KV pool and context window. Any field may be None (unknown).

    ``kv_pool_tokens`` is the pool that admission must respect: on a disaggregated node, the
    prefill pool (the incident's 681,280). ``pools`` names every pool found (``prefill``, ``decode``).
    """

    context_window: int | None = None
    kv_pool_tokens: int | None = None
    max_req_input_len: int | None = None
    page_size: int | None = None
    disaggregation_mode: str | None = None
    version: str | None = None
    pools: dict[str, int] = field(default_factory=dict)
    #: The most requests the node runs in one batch (SGLang's ``max_running_requests``).
    max_running_requests: int | None = None
    source: str = ""
    #: Other configuration the node states, as strings (``enable_prefix_caching``, ``verify_ownership``,
    #: ``model``, ``tp_size``...): what a known defect may require, and what a change of it fingerprints.
    facts: dict[str, str] = field(default_factory=dict)
    #: Each data-parallel rank's pool where the node lists them (SGLang's ``internal_states``);
    #: ``kv_pool_tokens`` is then the smallest, so a node's audit sees its smallest rank.
    rank_pools: dict[int, int] = field(default_factory=dict)
    #: A lookup went unanswered (no connection, a timeout, a 5xx): what is missing may be there.
    unanswered: bool = False

    @property
    def admission_limit(self) -> int | None:
        """Return the largest prompt the node can hold, or None when nothing is known."""
        known = [n for n in (self.context_window, self.kv_pool_tokens, self.max_req_input_len) if n]
        return min(known) if known else None


@dataclass(frozen=True)
class Node:
    """One serving node of a target. ``name`` is empty for a target that lists no nodes (one node
    at its base URL). ``role`` is ``aggregated`` (one node does both phases), ``prefill`` or ``decode``;
    a prefill node behind SGLang's gateway hands its K/V over at ``bootstrap_port`` of its host."""

    name: str
    role: str
    info_url: str
    metrics_url: str
    bootstrap_port: int | None = None
    #: Data-parallel ranks (SGLang's ``dp_size``): each a scheduler with a KV pool of its own.
    dp_size: int = 1
    #: A Prometheus page made from the node's log (mtail on SGLang's), read beside ``metrics_url``.
    log_metrics_url: str | None = None


@dataclass(frozen=True)
class ServingPath:
    """One prefill node and one decode node a disaggregated request can be served by, as SGLang's
    gateway pairs them. Each pair is a path of its own: its K/V hand-off, its decode pages."""

    prefill: Node
    decode: Node
    #: The pair's name where a node's name goes (results, incidents; ``path_name``).
    name: str
    #: The data-parallel rank on each side, where the node has several (None where it has one):
    #: each rank is a path of its own, reached by the rank fields and the bootstrap room.
    prefill_rank: int | None = None
    decode_rank: int | None = None

    @property
    def prefill_name(self) -> str:
        """Return the prefill side as metrics and evidence name it: the node, and its rank if any."""
        return ranked_name(self.prefill.name, self.prefill_rank)

    @property
    def decode_name(self) -> str:
        """Return the decode side as metrics and evidence name it: the node, and its rank if any."""
        return ranked_name(self.decode.name, self.decode_rank)


def ranked_name(node: str, rank: int | None) -> str:
    """Return a node's name with its data-parallel rank (``prefill-a.dp1``), or the name alone."""
    return node if rank is None else f"{node}.dp{rank}"


@dataclass(frozen=True)
class Fetched:
    """A GET's answer: ``text`` when a 2xx body arrived (within the byte limit), else ``error`` in words."""

    text: str | None
    error: str | None = None
    status: int | None = None


@dataclass(frozen=True)
class Scraped:
    """A node's Prometheus page, parsed: each sample's value summed over its labels, by sample name
    (``_info`` samples keep their labels in the key: ``kvcanary_worker_info{mode="aggregated",...}``).
    ``samples`` is None when the page could not be read (``reason`` ``metrics_unreachable``) or
    parsed (``metrics_unparseable``); ``error`` says why in words."""

    samples: dict[str, float] | None
    reason: str = ""
    error: str = ""


class TargetClient(Protocol):
    """A serving endpoint as probes see it. Implementations must not raise on network failure:
    they return a :class:`Completion` with ``status=None`` and ``error`` set, or None for lookups."""

    name: str
    engine: str
    tenants: list[str]
    nodes: list[Node]

    async def fetch(self, url: str) -> Fetched: ...

    async def scrape(self, url: str) -> Scraped: ...

    async def node_capacity(self, node: Node) -> ServerCapacity: ...

    async def complete(self, tenant: str, request: CompletionRequest) -> Completion: ...

    async def capacity(self, max_age: float = 0.0) -> ServerCapacity | None:
        """Return the target's capacity; a reading younger than ``max_age`` seconds may be reused."""
        ...

    async def count_tokens(self, text: str) -> int | None: ...

    def via(self, path: ServingPath) -> TargetClient:
        """Return this target with every completion sent down ``path`` (its prefill and decode nodes,
        as SGLang's gateway sends a request), its capacity that of the path's prefill node."""
        ...
