"""The session cache's offload tier: every finished sequence's K/V, kept in chunks after the ring moved on.

Why: the host ring (``workers.session_cache``) holds the last few finished sequences; a long
conversation that comes back after more traffic than that is found in a slower, larger tier, as
LMCache pages sessions to its local disk and llama.cpp's ``--cache-ram`` keeps idle slots' prompts.
Every saved sequence is written through to this tier in chunks of whole pages (LMCache stores every
tier at once), under an index naming the tokens each sequence holds; a lookup compares those tokens
with the prompt, so only identical text is restored, and only under the same cache domain.

``--bug session-offload-chunks`` (the bug zoo): a chunk is stored and read under its position in
the sequence alone, not under its sequence, so each write replaces the chunk at that position that
an earlier sequence wrote. The index still holds the returning conversation's tokens, so the
lookup claims a full hit, and the restore reads, chunk by chunk, the latest sequence long enough to
have written there: another conversation's context (LMCache#4385: a long session paged to disk came
back answering with facts from another conversation; #5151: the restored context is wrong although
the lookup claims a full hit; llama.cpp#27148: a fresh request continued an unrelated finished
conversation). Its trigger is a restore from this tier whose chunks a later sequence overwrote
with other tokens;
with ``--bug-rate`` the defect reads the overwritten chunks on a fraction of them, else the
sequence's own, as the fix (the worker without the flag) always does.

``--bug offload-salt-dropped`` (the bug zoo): the tier's keys leave the cache domain out (the
request's ``cache_salt`` and adapter), as connectors and tiers have dropped the salt the engine above
them honours (LMCache#4825: SGLang's path to LMCache dropped it, and another tenant hit the cache,
answering in 1.2 s where a miss took 3.4 s; LMCache#3008: LMCache ignored vLLM's salt). The ring
above it still keys by domain, so a request under another salt misses there and is restored here
from a sequence saved under another salt. Its trigger is a lookup that another domain's sequence
matches further than any of the request's own; with ``--bug-rate`` the defect takes that match on a
fraction of them, else the tier keys by domain, as the fix (the worker without the flag) always does.

Only the engine thread uses the tier.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the defect's trigger only
    from kvcanary.workers.zoo import BugTrigger


class OffloadTier:
    """Sequences in chunks of ``chunk`` positions, the newest ``kept`` of them (module docstring)."""

    def __init__(
        self,
        chunk: int,
        kept: int,
        *,
        misfiled: BugTrigger | None = None,
        salt_dropped: BugTrigger | None = None,
    ) -> None:
        self.chunk = chunk
        self.kept = kept
        self.misfiled = misfiled  # --bug session-offload-chunks: whether it fires on an overwritten chunk
        self.salt_dropped = salt_dropped  # --bug offload-salt-dropped: whether it fires on a foreign match
        self._ids = itertools.count()
        self._index: OrderedDict[int, tuple[tuple[int, ...], str | None]] = OrderedDict()
        self._chunks: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._latest: dict[int, int] = {}  # chunk position -> the sequence that wrote there last

    def put(self, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor, salt: str | None) -> None:
        """Keep the whole chunks of a finished sequence's K/V rows ``k``, ``v`` (host memory)."""
        count = len(tokens) // self.chunk
        if count == 0:
            return
        entry = next(self._ids)
        self._index[entry] = (tuple(tokens[: count * self.chunk]), salt)
        for i in range(count):
            rows = slice(i * self.chunk, (i + 1) * self.chunk)
            self._chunks[(entry, i)] = (k[rows].to("cpu", copy=True), v[rows].to("cpu", copy=True))
            self._latest[i] = entry
        while len(self._index) > self.kept:
            self._drop(next(iter(self._index)))

    def _drop(self, entry: int) -> None:
        tokens, _ = self._index.pop(entry)
        for i in range(len(tokens) // self.chunk):
            del self._chunks[(entry, i)]
            if self._latest.get(i) == entry:
                del self._latest[i]

    def match(self, prompt: Sequence[int], *, salt: str | None, limit: int) -> tuple[int, int | None]:
        """Return the longest whole-chunk run of ``prompt``'s first ``limit`` tokens a sequence under
        ``salt`` holds, and that sequence (newest first among equals); ``(0, None)`` when none
        holds a chunk's worth."""
        best, best_entry = self._longest(prompt, limit, salt)
        if self.salt_dropped is not None:
            blind, blind_entry = self._longest(prompt, limit, None, any_salt=True)
            if blind > best and self.salt_dropped.fires():
                return blind, blind_entry  # THE DEFECT: another domain's sequence, its salt unread
        return best, best_entry

    def _longest(
        self, prompt: Sequence[int], limit: int, salt: str | None, *, any_salt: bool = False
    ) -> tuple[int, int | None]:
        """Return the longest whole-chunk run of ``prompt`` a sequence under ``salt`` (any, with
        ``any_salt``) holds, and that sequence, newest first among equals."""
        best, best_entry = 0, None
        for entry, (tokens, entry_salt) in reversed(self._index.items()):
            if entry_salt != salt and not any_salt:
                continue
            shared = common_prefix(tokens, prompt, limit) // self.chunk * self.chunk
            if shared > best:
                best, best_entry = shared, entry
        return best, best_entry

    def read(self, entry: int, positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the K/V rows of ``entry``'s first ``positions`` (whole chunks) on ``device``."""
        owners = [entry] * (positions // self.chunk)
        overwritten = [self._latest.get(i, entry) for i in range(len(owners))]
        if self._differ(entry, overwritten) and self.misfiled is not None and self.misfiled.fires():
            owners = overwritten  # THE DEFECT: each chunk read where its position was written last
        parts = [self._chunks[(owner, i)] for i, owner in enumerate(owners)]
        return torch.cat([p[0] for p in parts]).to(device), torch.cat([p[1] for p in parts]).to(device)

    def _differ(self, entry: int, owners: list[int]) -> bool:
        """Return True when a chunk's last writer among ``owners`` holds other tokens there than
        ``entry`` does: reading it would restore another text (the trigger)."""
        tokens, c = self._index[entry][0], self.chunk
        return any(
            owner != entry and self._index[owner][0][i * c : (i + 1) * c] != tokens[i * c : (i + 1) * c]
            for i, owner in enumerate(owners)
        )


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Return how many leading tokens ``a`` and ``b`` share, at most ``limit``."""
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
