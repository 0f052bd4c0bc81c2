"""How a batch leaves the tap: the :class:`Batch` the sender hands over and the :class:`Transport`
that sends it.

:class:`~kvcanary.tap.http.HttpTransport` posts a batch to the monitor's ``/api/v1/traffic``
(taken whole or not at all; in halves where the monitor refuses it as too large, a record alone too
large dropped and counted); ``kvcanary/tap/jetstream.py`` publishes a batch's records of each
partition as a message to NATS JetStream, where the records up to the first whose message was not
acknowledged leave the queue and the rest wait. The sender's queue bounds, backoff and drop counts
are the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Batch:
    """The oldest records waiting, as one try sends them. ``id`` stays the same when the same records
    are tried again; ``dropped``: records dropped since the last report the monitor took."""

    id: str
    gateway: str
    dropped: int
    records: list[dict[str, Any]]


class Transport(Protocol):
    """How a batch leaves the tap. Called on the tap's thread only; never raises for the network."""

    def send(self, batch: Batch) -> tuple[int, int]:
        """Return (how many records from the head of ``batch`` were taken, how many of those were
        refused for ever). Taken records leave the queue; the rest wait for the next try."""
        ...

    def close(self) -> None:
        """Let go of connections and threads (the tap is closing)."""
        ...

    # Optional: ``after_fork_in_child() -> None``, called in a forked child before its first send,
    # for a transport holding threads, event loops or connections (none of which a child inherits
    # working). The Sender calls it where the transport has it.
