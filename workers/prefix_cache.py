"""PrefixCache: full KV pages reused across requests, keyed by a chained and salted hash of their tokens.

A prefix cache is both an engine's biggest prefill saving and an isolation boundary: a hit shows in
the first token's time and ``cached_tokens``, so a cache shared across tenants (``--prefix-cache
shared``) lets one tenant learn what another sent; ``per-tenant`` (the fix) salts every page with the
tenant of the API key.

A full page's key chains the digest of the pages before it with its own tokens, the tenant
(``per-tenant``) and, on page 0 only, the request's ``cache_salt``; a hit also compares the stored
parent, tokens and extra, so a digest collision alone never shares a page. Only full pages are
cached, and the last page is always recomputed. A published page belongs to the cache (a word no
request owns), so the worker's exact-word check refuses a reader of a page changed behind its back.
Off (``--prefix-cache off``), the same object only passes allocations and frees through to the pool.
Only the engine thread uses a cache.

``--bug prefix-key-partial`` keys a page on the prompt's first :data:`PARTIAL_KEY_PAGES` pages and
its index only, so two prompts that share those pages share every later full page too.

Keys, a page's life, ownership words and the defect in full: ``docs/architecture.md``, "Inside the
reference worker" (the prefix cache's paragraph).
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvcanary.workers.kv_cache import PagePool

if TYPE_CHECKING:  # the defect's trigger only
    from kvcanary.workers.zoo import BugTrigger

ROOT_DIGEST = bytes(32)
#: With ``--bug prefix-key-partial``, the pages whose tokens a key still covers (64 tokens at page 16).
PARTIAL_KEY_PAGES = 4


def _field(tag: bytes, value: bytes) -> bytes:
    return tag + len(value).to_bytes(8, "little") + value


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Return token ids as the bytes keys hold and hash: native int64 (keys never leave the process)."""
    return array("q", tokens).tobytes()


def page_digest(parent: bytes, tokens: bytes, extra: bytes) -> bytes:
    """Return the sha256 digest of a page: its parent's digest, its token ids (``token_bytes``) and its
    extra keys, each tagged and length-prefixed."""
    return hashlib.sha256(b"".join((parent, _field(b"tokens", tokens), _field(b"extra", extra)))).digest()


class PageKey(NamedTuple):
    """Everything a cached page must match: equality of all four fields is a hit.

    ``tokens`` are the page's token ids as ``token_bytes``: comparing them compares the ids. (A named
    tuple: a prompt of thousands of pages builds one per page, and a frozen dataclass is slower.)
    """

    digest: bytes
    parent: bytes
    tokens: bytes
    extra: bytes


@dataclass(eq=False)
class CachedPage:
    """A published page: its key, its physical page, the ownership word it was given, its users."""

    key: PageKey
    page: int
    word: int
    refs: int = 0
    #: The page's key as ``--bug prefix-key-partial`` makes it (None without the bug).
    partial: bytes | None = None


@dataclass
class PageLease:
    """The pages one request got for a prompt: cache hits first, then fresh pages.

    ``shared`` maps the index of every page the cache owns (hits, then the pages ``publish`` added)
    to the ownership word the page must hold; ``keys`` are the prompt's full-page keys.
    """

    pages: list[int]
    keys: list[PageKey]
    hit_pages: int
    page_size: int
    shared: dict[int, int] = field(default_factory=dict)
    partial_keys: list[PageKey] = field(default_factory=list)

    @property
    def cached_tokens(self) -> int:
        """Return the prompt tokens served from the cache: whole pages only."""
        return self.hit_pages * self.page_size


class PrefixCache:
    """The pages of one ``PagePool`` that the cache shares; ``mode`` is ``off``, ``shared`` or ``per-tenant``.

    ``evictions`` counts pages evicted so far (for tests and debugging).
    """

    def __init__(
        self,
        pool: PagePool,
        mode: str = "off",
        *,
        partial_key: BugTrigger | None = None,
        no_adapter: BugTrigger | None = None,
    ) -> None:
        if mode not in ("off", "shared", "per-tenant"):
            raise ValueError(f"unknown prefix cache mode {mode!r}")
        self.pool = pool
        self.mode = mode
        self.partial_key = partial_key  # --bug prefix-key-partial: whether it fires on a lookup
        self.no_adapter = no_adapter  # --bug prefix-key-no-adapter: whether it fires on an adapter's lookup
        self._by_digest: dict[bytes, CachedPage] = {}
        self._by_partial: dict[bytes, CachedPage] = {}  # with the defect only
        self._by_page: dict[int, CachedPage] = {}
        self._evictable: OrderedDict[int, CachedPage] = OrderedDict()  # front = evicted first
        self._entries = itertools.count(1)
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        """Return True unless the cache is off."""
        return self.mode != "off"

    @property
    def cached_pages(self) -> int:
        """Return how many pages the cache holds, in use or evictable."""
        return len(self._by_page)

    @property
    def evictable_pages(self) -> int:
        """Return how many cached pages no request uses."""
        return len(self._evictable)

    def entry(self, page: int) -> CachedPage | None:
        """Return the cache entry of physical ``page``, or None when the page is not cached."""
        return self._by_page.get(page)

    def can_alloc(self, num_pages: int) -> bool:
        """Return True when ``num_pages`` fresh pages can be had now, evicting unused cached pages."""
        return num_pages <= self.pool.free_pages + len(self._evictable)

    def page_keys(
        self,
        tokens: Sequence[int],
        *,
        tenant: str,
        cache_salt: str | None,
        partial: bool = False,
        adapter: str | None = None,
    ) -> list[PageKey]:
        """Return the keys of the full pages of ``tokens`` (empty with the cache off); ``partial``:
        the defect's keys, which leave out the tokens of every page after the first few."""
        if not self.enabled:
            return []
        size = self.pool.page_size
        tenant_key = _field(b"tenant", tenant.encode()) if self.mode == "per-tenant" else b""
        # The adapter on every page: K/V computed under one adapter is not another's (vLLM's LoRA id).
        tenant_key += _field(b"lora", adapter.encode()) if adapter else b""
        salt_key = _field(b"cache_salt", cache_salt.encode()) if cache_salt else b""
        data, width = token_bytes(tokens[: len(tokens) // size * size]), 8 * size
        # page_digest inlined, its constant fields built once: hashing is most of what a hit costs.
        tokens_tag = b"tokens" + width.to_bytes(8, "little")
        extras = (tenant_key + salt_key, tenant_key)
        tails = tuple(_field(b"extra", extra) for extra in extras)
        keys: list[PageKey] = []
        parent, sha256 = ROOT_DIGEST, hashlib.sha256
        for start in range(0, len(data), width):
            chunk, rest = data[start : start + width], start > 0
            if partial and start >= PARTIAL_KEY_PAGES * width:
                chunk = b""  # THE DEFECT: the page's own tokens are left out of its key
            digest = sha256(b"".join((parent, tokens_tag, chunk, tails[rest]))).digest()
            keys.append(PageKey(digest, parent, chunk, extras[rest]))
            parent = digest
        return keys

    def match(self, keys: Sequence[PageKey], limit: int) -> list[CachedPage]:
        """Return the cached pages of the longest run of ``keys[:limit]`` that hit, from the first."""
        hits: list[CachedPage] = []
        for key in keys[:limit]:
            entry = self._by_digest.get(key.digest)
            if entry is None or entry.key != key:
                break
            hits.append(entry)
        return hits

    def lease(
        self,
        tokens: Sequence[int],
        num_pages: int,
        *,
        request_id: int,
        tenant: str,
        cache_salt: str | None,
        adapter: str | None = None,
    ) -> PageLease:
        """Return ``num_pages`` pages for a prompt: its cached leading pages, then fresh ones.

        At most ``(len(tokens) - 1) // page_size`` pages hit, so at least one token is computed.
        Raises ``RuntimeError`` (holding nothing) when the fresh pages cannot be had.
        """
        if adapter is not None and self.no_adapter is not None and self.no_adapter.fires():
            adapter = (
                None  # THE DEFECT (prefix-key-no-adapter): the adapter's pages keyed as the base model's
            )
        keys = self.page_keys(tokens, tenant=tenant, cache_salt=cache_salt, adapter=adapter)
        limit = (len(tokens) - 1) // self.pool.page_size
        hits = self.match(keys, limit)
        partial_keys: list[PageKey] = []
        if self.partial_key is not None:
            partial_keys = self.page_keys(
                tokens, tenant=tenant, cache_salt=cache_salt, partial=True, adapter=adapter
            )
            hits += self._partial_hits(partial_keys, hits, limit)
        for entry in hits:
            entry.refs += 1
            self._evictable.pop(entry.page, None)
        try:
            fresh = self.alloc(num_pages - len(hits), request_id=request_id)
        except Exception:
            self.release([entry.page for entry in hits])
            raise
        return PageLease(
            pages=[entry.page for entry in hits] + fresh,
            keys=keys,
            hit_pages=len(hits),
            page_size=self.pool.page_size,
            shared={index: entry.word for index, entry in enumerate(hits)},
            partial_keys=partial_keys,
        )

    def _partial_hits(
        self, partial_keys: list[PageKey], hits: list[CachedPage], limit: int
    ) -> list[CachedPage]:
        """The defect's further hits: cached pages after the prompt's own hits whose partial keys match.

        Their trigger is a prompt that shares a cached prompt's first pages and differs after them
        (what the partial key would serve wrongly); ``--bug-rate`` decides on each one."""
        extra: list[CachedPage] = []
        taken = {entry.page for entry in hits}
        for key in partial_keys[len(hits) : limit]:
            entry = self._by_partial.get(key.digest)
            if entry is None or entry.page in taken:
                break
            extra.append(entry)
            taken.add(entry.page)
        if not extra or self.partial_key is None or not self.partial_key.fires():
            return []
        return extra  # THE DEFECT: pages holding other tokens, served as this prompt's

    def alloc(self, num_pages: int, *, request_id: int) -> list[int]:
        """Take ``num_pages`` fresh pages, evicting least recently released cached pages if the free
        list is short; raise ``RuntimeError`` (evicting nothing) when even that is not enough.
        """
        if not self.can_alloc(num_pages):
            raise RuntimeError(
                f"pool {self.pool.name!r}: {num_pages} pages asked, {self.pool.free_pages} free and "
                f"{len(self._evictable)} evictable"
            )
        short = num_pages - self.pool.free_pages
        if short > 0:
            self._evict(short)
        return self.pool.alloc(num_pages, request_id=request_id)

    def _evict(self, num_pages: int) -> None:
        victims = []
        for _ in range(num_pages):
            page, entry = self._evictable.popitem(last=False)
            del self._by_digest[entry.key.digest]
            del self._by_page[page]
            if entry.partial is not None and self._by_partial.get(entry.partial) is entry:
                del self._by_partial[entry.partial]
            victims.append(page)
        self.evictions += len(victims)
        self.pool.free(victims)  # really freed now: LIFO, zeroed with --zero-freed-pages

    def publish(self, lease: PageLease) -> None:
        """Hand the lease's freshly computed full prompt pages to the cache, the lease keeping a use.

        Call once the prompt's K/V is written. A page whose key is cached already (the copy a hit
        could not take, since one token must be computed) stays the request's own.
        """
        published: list[CachedPage] = []
        for index in range(lease.hit_pages, len(lease.keys)):
            key = lease.keys[index]
            if key.digest in self._by_digest:
                continue
            entry_id = next(self._entries)
            word = int(self.pool.ownership_word(-entry_id, self.pool.page_size))
            partial = lease.partial_keys[index].digest if lease.partial_keys else None
            entry = CachedPage(key=key, page=lease.pages[index], word=word, refs=1, partial=partial)
            self._by_digest[key.digest] = self._by_page[entry.page] = entry
            if partial is not None:
                self._by_partial.setdefault(partial, entry)
            lease.shared[index] = word
            published.append(entry)
        if published:
            device = self.pool.device
            pages = torch.tensor([entry.page for entry in published], device=device)
            self.pool.ownership[pages] = torch.tensor([entry.word for entry in published], device=device)

    def release(self, pages: Sequence[int]) -> None:
        """Give back one use of each of ``pages``: cached pages stay cached, the others are freed (LIFO).

        A cached page whose last user leaves becomes evictable; the pages of one release are queued
        last page first, so a prompt's tail is evicted before its head (the head serves more prompts).
        Raises ``RuntimeError`` when a cached page is released more often than it was used.
        """
        for page in reversed(pages):
            entry = self._by_page.get(page)
            if entry is None:
                continue
            if entry.refs <= 0:
                raise RuntimeError(f"cached page {page} released more often than it was used")
            entry.refs -= 1
            if entry.refs == 0:
                self._evictable[page] = entry
        self.pool.free([page for page in pages if page not in self._by_page])
