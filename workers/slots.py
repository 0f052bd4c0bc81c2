"""Batch slots: the place a running request holds in the engine, and the tokens kept there.

Like vLLM's persistent input batch, the engine gives every request that joins the batch a slot, and
keeps the request's tokens in the slot's buffer: prefill reads the prompt from there, and a request
that leaves leaves its whole sequence there (prompt and answer) for the next occupant to overwrite.
Slots are handed out most recently freed first, so a request that joins right after another left
takes the slot it left. Rows of the running batch (``workers.batch``) are another index: they are
compacted as requests leave, slots stay put. The sampling parameters are kept by slot too
(``workers.sampling``).

``--bug slot-stale-tokens`` (the bug zoo): with asynchronous scheduling and pipeline parallelism a
step is built while earlier ones are still in flight, and a slot's new occupant is written into the
slot's buffer only once they drain; a request that takes a slot freed while the batch kept running
is prefilled from the buffer before its own tokens land. Its K/V then holds the previous occupant's
tokens where that one had any, and a copy of them comes back in its answer: another user's tokens,
HTTP 200 (vLLM GHSA-v97p-wpxp-px84, fixed in 0.21.0: "tokens left in a batch slot by an earlier
request can be fed into another user's request and end up in its KV cache and output"). The
trigger is a slot taken while the batch has stayed busy since its last occupant left (a batch that
empties drains the pipeline, and every write lands); with ``--bug-rate`` the defect acts on a
fraction of them. The fix, which is the worker without the flag, writes the prompt before prefill
reads it.

Only the engine thread uses the slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcanary.workers.request import Request

if TYPE_CHECKING:  # the defect's trigger only
    from kvcanary.workers.zoo import BugTrigger


class Slots:
    """``count`` slots and their token buffers (module docstring); ``stale_tokens``: the defect's trigger."""

    def __init__(self, count: int, *, stale_tokens: BugTrigger | None = None) -> None:
        self.stale_tokens = stale_tokens
        self._free = list(range(count))[::-1]  # a stack: the most recently freed slot is taken first
        self._tokens: list[tuple[int, ...]] = [()] * count
        # How many times the batch emptied (the pipeline drained): a slot freed in the current
        # busy spell still has its previous occupant's steps in flight.
        self._spell = 0
        self._freed_in: list[int | None] = [None] * count

    def take(self, request: Request, *, busy: bool) -> None:
        """Give ``request`` the most recently freed slot and write its prompt into the slot's
        buffer; ``busy``: other requests are running."""
        slot = self._free.pop()
        request.slot = slot
        prompt, old = request.plan.input_ids, self._tokens[slot]
        late = busy and bool(old) and self._freed_in[slot] == self._spell
        if late and self.stale_tokens is not None and self.stale_tokens.fires():
            # THE DEFECT: the new occupant's tokens land after its prefill read the slot.
            self._tokens[slot] = old[: len(prompt)] + prompt[len(old) :]
        else:
            self._tokens[slot] = prompt

    def prompt(self, request: Request) -> tuple[int, ...]:
        """Return the prompt tokens prefill reads for ``request``: its slot's buffer, or its own
        prompt where it holds no slot (a prefill server's request never joins a batch)."""
        if request.slot is None:
            return request.plan.input_ids
        return self._tokens[request.slot][: len(request.plan.input_ids)]

    def free(self, request: Request) -> None:
        """Give back ``request``'s slot; its whole sequence stays in the buffer."""
        slot = request.slot
        if slot is None:
            return
        request.slot = None
        self._tokens[slot] = (*request.plan.input_ids, *request.generated)
        self._freed_in[slot] = self._spell
        self._free.append(slot)

    def drained(self) -> None:
        """Note that the batch emptied: nothing of a freed slot's previous occupant is in flight."""
        self._spell += 1
