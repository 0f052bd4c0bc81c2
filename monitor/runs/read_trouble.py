"""Discovery's failed reads: counted by target, node and read, and said once an episode.

A gateway that cannot be read, or a node whose join-time question goes unanswered, is counted
(``kvcanary_gateway_read_errors_total``) every time, and logged when the trouble starts and when it
ends, never at each of the reads in between: a gateway read every second would otherwise fill the
log with one line a second.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("kvcanary.discovery")


class ReadTrouble:
    """Reads of gateways and their nodes that failed: ``failures`` counts them by (target, node,
    read), ``""`` for the node of the gateway's own pages (``workers``, ``metrics``), and
    ``server_info`` and ``models`` for a node's join-time reads. An episode (a read failing from
    its first failure to its next success) is logged once as it starts and once as it ends."""

    def __init__(self) -> None:
        self.failures: dict[tuple[str, str, str], int] = {}
        self._failing: set[tuple[str, str, str]] = set()

    def failed(self, target: str, node: str, read: str, why: str) -> None:
        key = (target, node, read)
        self.failures[key] = self.failures.get(key, 0) + 1
        if key not in self._failing:
            self._failing.add(key)
            where = f"node {node}" if node else "gateway"
            log.warning("%s: %s: %s read failed: %s (counted in kvcanary_gateway_read_errors_total; "
                        "said again when it reads)", target, where, read, why)  # fmt: skip

    def succeeded(self, target: str, node: str, read: str) -> None:
        key = (target, node, read)
        if key in self._failing:
            self._failing.discard(key)
            log.info("%s: %s: %s reads again", target, f"node {node}" if node else "gateway", read)

    def keep(self, target: str, nodes: set[str]) -> None:
        """Forget ``target``'s nodes not in ``nodes`` (they left the listing): no series of theirs."""
        self._drop(lambda key: key[0] == target and key[1] != "" and key[1] not in nodes)

    def forget(self, target: str) -> None:
        """Forget everything of ``target`` (removed, or naming another gateway)."""
        self._drop(lambda key: key[0] == target)

    def _drop(self, gone: Callable[[tuple[str, str, str]], bool]) -> None:
        self.failures = {key: n for key, n in self.failures.items() if not gone(key)}
        self._failing = {key for key in self._failing if not gone(key)}
