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
so only identical text is ever restored, and only under the same ``cache_salt`` (the
``shared_prefix`` kind caught a first version that ignored salts: a fresh salt was served 272
cached tokens, as LMCache#4825's connector dropped them).

``--bug session-restore`` (the bug zoo): the slot's previous entry stays visible when a new
sequence is saved over it (its trigger: a returning conversation whose best match is such an entry;
with ``--bug-rate`` the defect restores from it on that fraction of them, else skips it), as a store
whose index update was lost (LMCache#4991: failed stores
stayed visible to lookups; LMCache#4385: a long session paged to disk came back with another
conversation's facts; llama.cpp#27148: a fresh slot restored an unrelated finished conversation,
20 of 20 rounds, about once a day in production). A conversation revisited after the ring went
round is restored from whatever sequence was saved over its slot: another conversation's text.

Behind the ring, every saved sequence is also written through to an offload tier
(``workers.offload``), which serves a conversation that returns after the ring moved on; a lookup
takes the longer of the two matches (the ring's on a tie). ``--bug session-offload-chunks`` breaks
that tier's chunk keys; ``--bug offload-salt-dropped`` leaves the cache salt out of its keys.

Only the engine thread uses the cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvcanary.workers.config import WorkerConfig
from kvcanary.workers.kv_cache import PagePool
from kvcanary.workers.offload import OffloadTier, common_prefix
from kvcanary.workers.request import Request

if TYPE_CHECKING:  # the defect's trigger only
    from kvcanary.workers.zoo import BugTrigger


class SessionEntry(NamedTuple):
    """What a slot claims to hold: the tokens of its positions ``[0, len(tokens))``."""

    tokens: tuple[int, ...]
    slot: int
    #: The ``cache_salt`` of the request that saved it: only a request with the same salt (or with
    #: none, as it had none) may be restored from it.
    salt: str | None = None
    #: Another sequence was saved over its slot since (kept only with ``--bug session-restore``).
    stale: bool = False


#: With the defect, entries kept at most per slot (the rest are stale): bounded memory on long runs,
#: and more than any churn burst writes (a first bound of 4 dropped the very entries the defect
#: serves stale, and the session kind's revisits passed: bench/bug_zoo.py at an 8,192-token pool).
STALE_KEPT = 128
#: Sequences the offload tier keeps, per ring slot.
OFFLOAD_KEPT = 8


@dataclass(frozen=True)
class Restored:
    """K/V rows of positions ``[0, positions)`` to write into a request's pages, and the tier that
    held them: ``session`` (the host ring) or ``offload``."""

    positions: int
    k: torch.Tensor
    v: torch.Tensor
    tier: str = "session"


class SessionCache:
    """A host-memory ring of ``slots`` finished sequences (see the module docstring)."""

    def __init__(
        self,
        slots: int,
        page_size: int,
        *,
        stale_entries: BugTrigger | None = None,
        misfiled_chunks: BugTrigger | None = None,
        salt_dropped: BugTrigger | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"a session cache needs at least one slot, got {slots}")
        self.page_size = page_size
        self.stale_entries = stale_entries  # --bug session-restore: whether it fires on a reused slot
        self.offload = OffloadTier(
            page_size, OFFLOAD_KEPT * slots, misfiled=misfiled_chunks, salt_dropped=salt_dropped
        )
        self._data: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * slots
        self._entries: list[SessionEntry] = []
        self._next = 0

    @classmethod
    def configured(cls, config: WorkerConfig, triggers: Mapping[str, BugTrigger]) -> SessionCache | None:
        """Return the cache ``--session-cache`` asks for (None when it is 0: off), with the triggers
        of its defects among ``triggers``."""
        if not config.session_cache:
            return None
        return cls(
            config.session_cache,
            config.page_size,
            stale_entries=triggers.get("session-restore"),
            misfiled_chunks=triggers.get("session-offload-chunks"),
            salt_dropped=triggers.get("offload-salt-dropped"),
        )

    def save(
        self, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor, *, salt: str | None = None
    ) -> None:
        """Keep the K/V rows ``k``, ``v`` of positions ``[0, len(tokens))`` in the next slot."""
        if len(tokens) < self.page_size:
            return  # nothing a later request could take: restores are whole pages
        slot = self._next
        self._next = (slot + 1) % len(self._data)
        if self.stale_entries is None:
            self._entries = [e for e in self._entries if e.slot != slot]
        else:  # THE DEFECT: the slot's old entry still claims the old tokens
            self._entries = [e._replace(stale=True) if e.slot == slot else e for e in self._entries]
        self._data[slot] = (k.detach().to("cpu", copy=True), v.detach().to("cpu", copy=True))
        self._entries.append(SessionEntry(tuple(tokens), slot, salt))
        self.offload.put(tokens, k, v, salt)
        if len(self._entries) > STALE_KEPT * len(self._data):  # stale ones, oldest first, go at last
            self._entries.pop(next(i for i, e in enumerate(self._entries) if e.stale))

    def lookup(
        self, prompt: Sequence[int], device: torch.device, *, salt: str | None = None
    ) -> Restored | None:
        """Return the longest whole-page run of ``prompt``'s leading tokens some entry holds (one
        token always left to compute), or None when no entry shares a page's worth."""
        best, best_entry = self._best(prompt, salt, stale=True)
        # The trigger: a returning conversation whose saved K/V was overwritten by other text (a
        # stale entry whose slot now holds the same leading tokens restores them rightly).
        wrong = best_entry is not None and best_entry.stale and self._overwritten(best_entry, prompt, best)
        if wrong and (self.stale_entries is None or not self.stale_entries.fires()):
            wrong = False
            best, best_entry = self._best(prompt, salt, stale=False)
        data = self._data[best_entry.slot] if best_entry is not None else None
        positions = min(best, data[0].shape[0]) // self.page_size * self.page_size if data is not None else 0
        if not wrong:  # the stale entry the defect chose is read, whatever else holds the text
            limit = (len(prompt) - 1) // self.page_size * self.page_size
            offloaded, entry = self.offload.match(prompt, salt=salt, limit=limit)
            if entry is not None and offloaded > positions:
                k, v = self.offload.read(entry, offloaded, device)
                return Restored(offloaded, k, v, "offload")
        if data is None or positions < self.page_size:
            return None
        return Restored(positions, data[0][:positions].to(device), data[1][:positions].to(device))

    def _overwritten(self, entry: SessionEntry, prompt: Sequence[int], shared: int) -> bool:
        """Return True when ``entry``'s slot now holds other tokens than ``prompt`` in its first
        ``shared`` positions (whole pages): restoring from it would restore another text."""
        current = next((e for e in reversed(self._entries) if e.slot == entry.slot and not e.stale), None)
        positions = shared // self.page_size * self.page_size
        return current is None or tuple(current.tokens[:positions]) != tuple(prompt[:positions])

    def _best(
        self, prompt: Sequence[int], salt: str | None, *, stale: bool
    ) -> tuple[int, SessionEntry | None]:
        """Return the longest whole-page-capped run of ``prompt`` an entry under ``salt`` holds, and
        that entry (stale entries only when ``stale``); newest first among equals."""
        limit = (len(prompt) - 1) // self.page_size * self.page_size
        best, best_entry = 0, None
        for entry in reversed(self._entries):
            if entry.salt != salt or (entry.stale and not stale):
                continue
            shared = common_prefix(entry.tokens, prompt, limit)
            if shared > best:
                best, best_entry = shared, entry
        return best, best_entry


def restore_into(cache: SessionCache, pool: PagePool, request: Request) -> tuple[int, str | None]:
    """Write what ``cache`` holds of ``request``'s prompt into its pages (tagged as its own writes);
    return the positions restored (0: prefill computes the whole prompt) and the tier that held them
    (None when none did)."""
    restored = cache.lookup(request.plan.input_ids, pool.device, salt=_domain(request))
    if restored is None:
        return 0, None
    pool.write_prefix(
        request.pages,
        restored.k,
        restored.v,
        request_id=request.request_id,
        tenant_index=request.tenant_index,
    )
    return restored.positions, restored.tier


def save_from(cache: SessionCache, pool: PagePool, request: Request) -> None:
    """Save the positions a finished ``request`` wrote: its prompt and all but its last token."""
    tokens = [*request.plan.input_ids, *request.generated[:-1]]
    slots = pool.slot_index(request.pages, len(tokens))
    k, v = pool.k.view(-1, pool.head_dim)[slots], pool.v.view(-1, pool.head_dim)[slots]
    cache.save(tokens, k, v, salt=_domain(request))


def _domain(request: Request) -> str | None:
    """The cache domain a sequence belongs to: its ``cache_salt`` and LoRA adapter, tagged apart."""
    if request.cache_salt is None and request.adapter is None:
        return None
    return f"salt={request.cache_salt!r};lora={request.adapter!r}"
