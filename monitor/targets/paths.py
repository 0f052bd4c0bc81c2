"""A target as one prefill x decode pair serves it: probes sent down a path of their choosing.

Behind SGLang's model gateway every request goes to one prefill node and one decode node, and the
gateway's policy picks them: a probe sent through it judges whichever pair it landed on, and a
faulty prefill node among eight is hit one probe in eight, or never under a cache-aware policy. A
:class:`PathTarget` is the target's client with every completion sent down one named pair the way
the gateway sends it (``OpenAIHttpTarget.complete(via=...)``: both nodes at once, the bootstrap
fields, a new room), its capacity read from that pair's prefill node (the pool admission must
respect there) and its prompts counted by that node's tokenizer. A probe kind run on it judges that
path and no other; the runner runs the target's ``path_probes`` on every path.

Both legs go through the target's one request path (``OpenAIHttpTarget.request``): a node the
gateway listed outside the target's credential scope is sent no key, and is probed without one.
What a path needs of its target is :class:`PathCarrier`, which ``OpenAIHttpTarget`` is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
from collections.abc import Callable, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
from yarl import URL

from kvcanary.monitor.targets.capacity import apply_overrides
from kvcanary.monitor.targets.http import chunks
from kvcanary.monitor.targets.openai_format import ERROR_BODY_BYTES, StreamState, read_bounded, take_error
from kvcanary.probes.target import (
    Completion,
    CompletionRequest,
    Fetched,
    Node,
    Scraped,
    ServerCapacity,
    ServingPath,
    TargetClient,
)

#: How a completion's body reaches the engine and its answer is read: (tenant, the API path, the
#: body, the request, the state to read into). ``OpenAIHttpTarget.exchange`` to the base URL by default.
Send = Callable[[str, str, dict[str, Any], CompletionRequest, StreamState], Coroutine[Any, Any, None]]


class PathCarrier(TargetClient, Protocol):
    """The target whose requests a :class:`PathTarget` sends down its path (``OpenAIHttpTarget``):
    its lookups, and the one request path and completion exchange both legs go through."""

    @property
    def overrides(self) -> dict[str, Any]:
        """What the operator states of the target's capacity."""
        ...

    async def complete(
        self, tenant: str, request: CompletionRequest, *, send: Send | None = None
    ) -> Completion:
        """Send one completion as ``tenant``, delivered by ``send``; never raise."""
        ...

    async def exchange(
        self, tenant: str, url: URL, body: dict[str, Any], request: CompletionRequest, state: StreamState
    ) -> None:
        """POST ``body`` to ``url`` as ``tenant`` and read the answer into ``state``."""
        ...

    def request(
        self,
        method: str,
        url: URL,
        *,
        tenant: str | None,
        headers: Mapping[str, str] = ...,
        data: bytes | None = None,
    ) -> AbstractAsyncContextManager[aiohttp.ClientResponse]:
        """Send one request of the target's to ``url`` with the credential its scope allows there."""
        ...

    def headers_for(self, request: CompletionRequest) -> dict[str, str]:
        """The headers a completion carries besides its credential."""
        ...

    async def count_tokens(self, text: str, *, at: Node | None = None) -> int | None:
        """Count ``text``'s tokens, at ``at``'s own API where given."""
        ...


class PathTarget:
    """``target`` with its completions sent down ``path``; lookups as the target makes them."""

    def __init__(self, target: PathCarrier, path: ServingPath):
        self._target = target
        self.path = path
        self.name = target.name
        self.engine = target.engine
        self.tenants = target.tenants
        self.nodes = [path.prefill, path.decode]
        self._overrides = target.overrides

    async def complete(self, tenant: str, request: CompletionRequest) -> Completion:
        return await self._target.complete(tenant, request, send=self._down_path)

    async def _down_path(
        self, tenant: str, route: str, body: dict[str, Any], request: CompletionRequest, state: StreamState
    ) -> None:
        """Send ``body`` to the pair's prefill and decode nodes at once, with the bootstrap fields the
        gateway adds (the prefill node's host and port, a new random 63-bit room), and answer as the
        gateway does: decode's answer, unless prefill refused or failed, whose answer is then the
        client's (a refused prefill leaves decode waiting on a room that never comes)."""
        body = {**body, **bootstrap_fields(self.path.prefill, self.path.prefill_rank)}
        legs = rank_fields(self.path)
        prefill = asyncio.ensure_future(self._prefill_leg(tenant, route, body | legs["prefill"], request))
        decode_url = URL(node_base(self.path.decode) + route)
        decode = asyncio.ensure_future(
            self._target.exchange(tenant, decode_url, body | legs["decode"], request, state)
        )
        try:
            await asyncio.wait((prefill, decode), return_when=asyncio.FIRST_COMPLETED)
            if prefill.done() and prefill.result() is not None:
                decode.cancel()
            else:
                await decode
            # Decode answered 2xx only with the room's K/V in hand: prefill's answer follows at once.
            # A decode that refused leaves prefill waiting for a fetch that never comes.
            answered = state.status is not None and 200 <= state.status < 300
            refusal = await prefill if answered or prefill.done() else None
        finally:
            for leg in (prefill, decode):
                leg.cancel()
        if refusal is not None:  # what decode had begun to say (its headers, a 500) is not the answer
            fresh = StreamState(chat=state.chat, started=state.started)
            for name in (f.name for f in dataclasses.fields(StreamState)):
                setattr(state, name, getattr(fresh, name))
            take_error(state, *refusal)

    async def _prefill_leg(
        self, tenant: str, route: str, body: dict[str, Any], request: CompletionRequest
    ) -> tuple[int, str] | None:
        """Send the prefill node its copy (never streamed: it answers once the K/V is handed over);
        return its status and error body when it did not answer 2xx, else None."""
        async with self._target.request(
            "POST",
            URL(node_base(self.path.prefill) + route),
            tenant=tenant,
            headers=self._target.headers_for(request),
            data=json.dumps({**body, "stream": False}).encode(),
        ) as response:
            raw = await read_bounded(chunks(response), ERROR_BODY_BYTES)
            return None if 200 <= response.status < 300 else (response.status, raw)

    async def capacity(self, max_age: float = 0.0) -> ServerCapacity:
        """Return what the path can hold, read afresh (a path run is one of many): the prefill node's
        pool, which admission must respect, and the smaller of both nodes' context windows and
        longest inputs (a decode node that refuses a prompt refuses it for the whole path). What the
        operator stated fills only what the nodes leave unsaid, so one small pool is never hidden."""
        prefill, decode = await asyncio.gather(
            self._target.node_capacity(self.path.prefill), self._target.node_capacity(self.path.decode)
        )
        prefill, decode = of_rank(prefill, self.path.prefill_rank), of_rank(decode, self.path.decode_rank)
        found = dataclasses.replace(
            prefill,
            context_window=_least(prefill.context_window, decode.context_window),
            max_req_input_len=_least(prefill.max_req_input_len, decode.max_req_input_len),
            source=f"prefill {prefill.source}; decode {decode.source}",
        )
        unsaid = {key: value for key, value in self._overrides.items() if getattr(found, key, None) is None}
        return apply_overrides(found, unsaid)

    async def count_tokens(self, text: str) -> int | None:
        return await self._target.count_tokens(text, at=self.path.prefill)

    async def node_capacity(self, node: Node) -> ServerCapacity:
        return await self._target.node_capacity(node)

    async def fetch(self, url: str) -> Fetched:
        return await self._target.fetch(url)

    async def scrape(self, url: str) -> Scraped:
        return await self._target.scrape(url)

    def via(self, path: ServingPath) -> TargetClient:
        return self._target.via(path)


def node_base(node: Node) -> str:
    """Return the URL a node's own API paths (``/v1/...``) follow."""
    return node.info_url.rstrip("/").removesuffix("/v1")


def bootstrap_fields(prefill: Node, rank: int | None = None) -> dict[str, Any]:
    """Return the fields SGLang's gateway adds to a disaggregated request's body for ``prefill``: where
    decode fetches the K/V, and a room no other request in flight has (63 random bits, as the
    gateway's). For a rank of a data-parallel prefill node the room is one that ``room % dp_size``
    maps to that rank: the rule a prefill server follows when no rank is named, and by which a
    decode server finds the prefill rank holding the K/V (a gateway that knows ranks aligns them so)."""
    if rank is None:
        room = secrets.randbits(63)
    else:  # 62 random bits leave room for the rank: an aligned room never passes 2**63 - 1
        room = secrets.randbits(62)
        room = room - room % prefill.dp_size + rank
    return {
        "bootstrap_host": urlsplit(prefill.info_url).hostname,
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": room,
    }


def rank_fields(path: ServingPath) -> dict[str, dict[str, int]]:
    """Return the fields naming the path's data-parallel ranks, per leg, as SGLang's gateway sends
    them to DP-aware servers: ``routed_dp_rank`` (the rank that serves the leg) to each, and to
    decode ``disagg_prefill_dp_rank`` (where its K/V is). The deprecated ``data_parallel_rank`` is
    never sent: on a decode server of releases before them it also named the prefill rank, so a
    decode rank other than the prefill's would send decode looking for K/V that is not there; such
    a server leaves its decode rank to its own turn, and the room still picks the prefill rank."""
    prefill: dict[str, int] = {}
    decode: dict[str, int] = {}
    if path.prefill_rank is not None:
        prefill["routed_dp_rank"] = path.prefill_rank
        decode["disagg_prefill_dp_rank"] = path.prefill_rank
    if path.decode_rank is not None:
        decode["routed_dp_rank"] = path.decode_rank
    return {"prefill": prefill, "decode": decode}


def of_rank(capacity: ServerCapacity, rank: int | None) -> ServerCapacity:
    """Return a node's capacity as one of its data-parallel ranks has it: that rank's pool where the
    node lists its ranks' (``rank_pools``), else the node's own figures (its smallest pool)."""
    if rank is None or rank not in capacity.rank_pools:
        return capacity
    return dataclasses.replace(capacity, kv_pool_tokens=capacity.rank_pools[rank])


def _least(*figures: int | None) -> int | None:
    known = [n for n in figures if n]
    return min(known) if known else None
