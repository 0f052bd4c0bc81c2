"""Per-request sampling parameters (``request.SamplingParams``), kept in a table of batch slots that
each decode step reads.

Like vLLM's persistent input batch, the engine keeps each running request's parameters in a table
indexed by its **slot** (``workers.slots``), and a decode step reads the entry of every row's slot:
the allowed-token mask goes to the model's argmax, the thinking state forces tokens, the stop
strings end answers. Rows are compacted as requests leave (the last row fills the gap), so a row's
index and its slot's part as soon as the batch's composition changes.

``--bug sampling-rows-stale`` (the bug zoo; its cases in ``docs/architecture.md``): a request whose
row no longer matches its slot reads the entry at its *row* index: another request's parameters,
or those a finished request left in a slot nobody cleared. The trigger is a request running in a
row other than its slot (counted once a request); the fix, which is the worker without the flag,
reads every row's own slot.

Only the engine thread uses the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvcanary.workers.model import VOCAB_SIZE
from kvcanary.workers.request import Request, SamplingParams

if TYPE_CHECKING:  # the defect's trigger
    from kvcanary.workers.zoo import BugTrigger


@dataclass
class _Entry:
    """One slot's entry: the parameters of the request that took the slot last, and its thinking
    state (tokens left before the end string is forced, and how much of it was forced)."""

    params: SamplingParams
    thinking_left: int | None
    forced: int = 0


class SamplingTable:
    """The entries of ``slots`` batch slots (module docstring); ``stale_rows`` is the defect's trigger."""

    def __init__(
        self,
        slots: int,
        device: torch.device,
        *,
        reasoning_end: bytes = b"",
        stale_rows: BugTrigger | None = None,
    ) -> None:
        self.reasoning_end = reasoning_end
        self.stale_rows = stale_rows
        self._entries = [_Entry(SamplingParams(), None) for _ in range(slots)]
        # True where a token is allowed; a slot without an allowlist allows all.
        self._masks = torch.ones((slots, VOCAB_SIZE), dtype=torch.bool, device=device)
        self._masked: set[int] = set()  # slots whose entry has an allowlist
        self._reads_row: dict[int, bool] = {}  # request id -> the defect took it over (decided once)

    def load(self, slot: int, params: SamplingParams) -> None:
        """Write a joining request's parameters into its slot's entry."""
        budget = params.thinking_budget if self.reasoning_end else None
        self._entries[slot] = _Entry(params, budget)
        if params.allowed is None:
            self._masks[slot].fill_(True)
            self._masked.discard(slot)
            return
        self._masks[slot].fill_(False)
        self._masks[slot, torch.tensor(sorted(params.allowed), dtype=torch.int64)] = True
        self._masked.add(slot)

    def entries(self, requests: list[Request]) -> list[int]:
        """Return the entry each row reads this step: its request's slot, or (the defect) its row."""
        out = []
        for row, request in enumerate(requests):
            slot = request.slot if request.slot is not None else row
            out.append(row if slot != row and self._stale(request) else slot)
        return out

    def _stale(self, request: Request) -> bool:
        """Return whether the defect reads ``request``'s row: decided at its first step off its slot."""
        if self.stale_rows is None:
            return False
        decided = self._reads_row.get(request.request_id)
        if decided is None:
            decided = self._reads_row[request.request_id] = self.stale_rows.fires()
        return decided

    def forget(self, request: Request) -> None:
        """Drop what the table knows of a request that left."""
        self._reads_row.pop(request.request_id, None)

    def masks(self, entries: list[int]) -> torch.Tensor | None:
        """Return the step's allowed-token masks ``[B, VOCAB]``, or None when no row's entry has one."""
        if not self._masked.intersection(entries):
            return None
        index = torch.tensor(entries, dtype=torch.int64, device=self._masks.device)
        return self._masks.index_select(0, index)

    def force(self, entries: list[int], tokens: list[int]) -> list[int]:
        """Return ``tokens`` with the reasoning-end string forced where an entry's thinking budget ran
        out, advancing each entry's thinking state by one token."""
        if not self.reasoning_end:
            return tokens
        out = list(tokens)
        for row, index in enumerate(entries):
            entry = self._entries[index]
            if entry.thinking_left is None or out[row] < 0:
                continue
            if entry.thinking_left > 0:
                entry.thinking_left -= 1
            elif entry.forced < len(self.reasoning_end):
                out[row] = self.reasoning_end[entry.forced]
                entry.forced += 1
        return out

    def stops(self, index: int) -> tuple[bytes, ...]:
        """Return the stop strings of entry ``index``."""
        return self._entries[index].params.stop


def stop_split(generated: list[int], sent: int, stops: tuple[bytes, ...]) -> tuple[int, bool]:
    """Return how many of ``generated`` may be sent now (``sent`` were) and whether a stop string
    ended the answer (it is then cut before the first one, which is never sent).

    While the answer's tail could still become a stop string it is held back, so a stream never
    sends what a stop string will take back; a stop string therefore starts in what was not sent.
    """
    text = bytes(generated[sent:])
    found = [at for s in stops if (at := text.find(s)) >= 0]
    if found:
        return sent + min(found), True
    hold = max(
        (n for s in stops for n in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:n])), default=0
    )
    return max(sent, len(generated) - hold), False
