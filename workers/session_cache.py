"""SessionCache: finished conversations' K/V kept in host memory, restored when a conversation returns.

Why the worker has one: a long conversation comes back turn after turn, each turn's prompt starting
with the whole of the previous turn. Engines keep finished sequences' K/V in a slower tier and copy
it back instead of recomputing it: llama.cpp's ``--cache-ram`` prompt cache (whole slot states),
LMCache's CPU and disk tiers, vLLM's and TensorRT-LLM's host offload. That tier is a second
isolation boundary: what it restores must be what the returning request sent.

How (``--session-cache N``): a ring of ``N`` host slots. A request that finishes saves the K/V of
every position it wrote (its prompt and all but its last token) into the next slot, with an entry
naming the tokens it holds; the slot's previous entry is dropped. A new request takes, from the
entry sharing the longest run of leading tokens with its prompt, that run's K/V in whole pages
(at least one page, and one token left to compute), written into its own pages as if prefill had
computed them: a restore is a copy, so the request's pages stay its own, and tokens are compared,
so only identical text is ever restored.

``--bug session-restore`` (the bug zoo): the slot's previous entry stays visible when a new
sequence is saved over it, as a store whose index update was lost (LMCache#4991: failed stores
stayed visible to lookups; LMCache#4385: a long session paged to disk came back with another
conversation's facts; llama.cpp#27148: a fresh slot restored an unrelated finished conversation,
20 of 20 rounds, about once a day in production). A conversation revisited after the ring went
round is restored from whatever sequence was saved over its slot: another conversation's text.

Only the engine thread uses the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.kv_cache import PagePool
from workers.request import Request


@dataclass(frozen=True)
class SessionEntry:
    """What a slot claims to hold: the tokens of its positions ``[0, len(tokens))``."""

    tokens: tuple[int, ...]
    slot: int


@dataclass(frozen=True)
class Restored:
    """K/V rows of positions ``[0, positions)`` to write into a request's pages."""

    positions: int
    k: torch.Tensor
    v: torch.Tensor


class SessionCache:
    """A host-memory ring of ``slots`` finished sequences (see the module docstring)."""

    def __init__(self, slots: int, page_size: int, *, stale_entries: bool = False) -> None:
        if slots < 1:
            raise ValueError(f"a session cache needs at least one slot, got {slots}")
        self.page_size = page_size
        self.stale_entries = stale_entries  # --bug session-restore
        self._data: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * slots
        self._entries: list[SessionEntry] = []
        self._next = 0
        self.saves = 0
        self.restored_tokens = 0

    def save(self, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep the K/V rows ``k``, ``v`` of positions ``[0, len(tokens))`` in the next slot."""
        if len(tokens) < self.page_size:
            return  # nothing a later request could take: restores are whole pages
        slot = self._next
        self._next = (slot + 1) % len(self._data)
        if not self.stale_entries:
            self._entries = [e for e in self._entries if e.slot != slot]
        # THE DEFECT, with stale_entries: the slot's old entry still claims the old tokens.
        self._data[slot] = (k.detach().to("cpu", copy=True), v.detach().to("cpu", copy=True))
        self._entries.append(SessionEntry(tuple(tokens), slot))
        self.saves += 1

    def lookup(self, prompt: Sequence[int], device: torch.device) -> Restored | None:
        """Return the longest whole-page run of ``prompt``'s leading tokens some entry holds (one
        token always left to compute), or None when no entry shares a page's worth."""
        limit = (len(prompt) - 1) // self.page_size * self.page_size
        best, best_entry = 0, None
        for entry in reversed(self._entries):  # newest first: the likeliest to return
            shared = _common_prefix(entry.tokens, prompt, limit)
            if shared > best:
                best, best_entry = shared, entry
        data = self._data[best_entry.slot] if best_entry is not None else None
        if data is None:
            return None
        positions = min(best, data[0].shape[0]) // self.page_size * self.page_size
        if positions < self.page_size:
            return None
        self.restored_tokens += positions
        return Restored(positions, data[0][:positions].to(device), data[1][:positions].to(device))


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def restore_into(cache: SessionCache, pool: PagePool, request: Request) -> int:
    """Write what ``cache`` holds of ``request``'s prompt into its pages (tagged as its own writes);
    return the positions restored (0: prefill computes the whole prompt)."""
    restored = cache.lookup(request.plan.input_ids, pool.device)
    if restored is None:
        return 0
    pool.write_prefix(
        request.pages,
        restored.k,
        restored.v,
        request_id=request.request_id,
        tenant_index=request.tenant_index,
    )
    return restored.positions


def save_from(cache: SessionCache, pool: PagePool, request: Request) -> None:
    """Save the positions a finished ``request`` wrote: its prompt and all but its last token."""
    tokens = [*request.plan.input_ids, *request.generated[:-1]]
    slots = pool.slot_index(request.pages, len(tokens))
    cache.save(tokens, pool.k.view(-1, pool.head_dim)[slots], pool.v.view(-1, pool.head_dim)[slots])
