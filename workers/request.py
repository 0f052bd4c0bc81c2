"""A request inside the engine, and the events the engine sends back to whoever submitted it.

The engine thread calls ``Request.emit`` with ``TokenEvent``s, then exactly one ``FinishEvent`` or
``ErrorEvent``; nothing follows that terminal event. An aborted request gets no events at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcanary.workers.admission import AdmissionPlan

if TYPE_CHECKING:  # the decode server's received K/V
    from kvcanary.workers.pd_transfer import KVHandoff


@dataclass(frozen=True)
class SamplingParams:
    """What one request asked besides its budget, as vLLM takes it; the default asks nothing.

    ``stop``: strings that end the answer, which stops before the first one and never sends it;
    ``allowed``: the only tokens it may be given (vLLM's ``allowed_token_ids``; a byte here);
    ``thinking_budget``: after that many tokens the engine forces the reasoning-end string
    (``--reasoning-end-str``) into the answer, one token a step (no end string: no effect).
    """

    stop: tuple[bytes, ...] = ()
    allowed: frozenset[int] | None = None
    thinking_budget: int | None = None


@dataclass(frozen=True)
class TokenEvent:
    """One generated token."""

    token_id: int


@dataclass(frozen=True)
class FinishEvent:
    """Generation ended normally; ``reason`` is OpenAI's ``finish_reason`` (``stop`` or ``length``).

    ``cached_tokens`` is None when the prefix cache is off, else the prompt tokens it served.
    """

    reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None


@dataclass(frozen=True)
class ErrorEvent:
    """Generation failed; the fields are the OpenAI error body and its HTTP status."""

    status: int
    message: str
    type: str
    code: int | str


Event = TokenEvent | FinishEvent | ErrorEvent

OWNERSHIP_VIOLATION = ErrorEvent(500, "KV page ownership check failed", "kv_ownership_violation", 500)


@dataclass(eq=False)
class Request:
    """A submitted request: its plan, its decode pages and what it generated so far.

    ``shared_words`` maps the index of each decode page the prefix cache owns (aggregated mode only) to
    the ownership word the page must hold while the request reads it; every other page is the
    request's own. ``cached_tokens`` are the prompt tokens that prefill took from the cache.
    """

    request_id: int
    tenant: str
    tenant_index: int
    plan: AdmissionPlan
    emit: Callable[[Event], None]
    cache_salt: str | None = None
    #: The LoRA adapter the request asked for (None: the base model).
    adapter: str | None = None
    #: The id the client gave the request (SGLang's ``rid``, ``X-Request-Id``, the body's ``user``).
    client_id: str | None = None
    #: What it asked besides its budget: stop strings, allowed tokens, a thinking budget.
    sampling: SamplingParams = field(default_factory=SamplingParams)
    #: Prefill and decode servers: the gateway's ``bootstrap_room`` the request's K/V travel under.
    bootstrap_room: int | None = None
    #: Decode server: the K/V the prefill server sent, until written into the request's pages.
    handoff: KVHandoff | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    pages: list[int] = field(default_factory=list)
    shared_words: dict[int, int] = field(default_factory=dict)
    cached_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    #: How many of ``generated`` its client was sent (a stream holds back what a stop string may take).
    sent: int = 0
    #: Its batch slot while it runs (``workers.slots``); None before it joins and after it leaves.
    slot: int | None = None
    aborted: bool = False
    #: True once the request ended normally (its FinishEvent was emitted).
    finished: bool = False
    #: True once the engine let go of it: retired from the batch, or refused before it joined.
    retired: bool = False

    @property
    def seq_len(self) -> int:
        """Return the positions the next step attends: the believed prompt plus the tokens generated."""
        return self.plan.decode_len + len(self.generated)

    def finish_reason(self, page_size: int) -> str | None:
        """Return ``stop``, ``length`` or None (keep decoding) after the latest token.

        ``stop`` means one whole copy of the prompt was echoed; ``length`` means the budget or the
        reserved pages ran out first.
        """
        done = len(self.generated)
        if done >= self.plan.max_new_tokens:
            return "stop" if done >= self.plan.decode_len else "length"
        next_write = self.plan.decode_len + done - 1
        if next_write >= min(self.plan.reserve_tokens, len(self.pages) * page_size):
            return "length"
        return None
