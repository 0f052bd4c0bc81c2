"""A message of the traffic stream read as records: a tap batch's share of one partition
(``docs/tap-protocol.md``), decoded as the HTTP ingest decodes a body, with what its headers say
taken only as far as the message could carry it.

- a message without ``Kvcanary-Version``, or of a version this monitor does not speak (a tap of
  another version: its prints are not this window's), is never read: its records are counted
  rejected and refused by version (``monitor/metrics/versions.py``'s ``REFUSED_VERSIONS``), as many
  as ``Kvcanary-Records`` says, bounded as below;
- a message that is no batch is counted as rejected records: its ``Kvcanary-Records`` count, at
  least 1 and at most what its bytes could hold;
- its drop report (``Kvcanary-Dropped``) is at most what a body may report (``MAX_DROPPED``);
- a record whose ``api_base`` does not hash to the partition it came on belongs to another
  partition's window, or to none (a copy published on several): :func:`by_partition` sets it
  apart, and the consumer refuses it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import ValidationError

from kvcanary.monitor.metrics.versions import REFUSED_VERSIONS
from kvcanary.monitor.traffic.pipeline import Arrival
from kvcanary.monitor.traffic.reading import read_batch
from kvcanary.monitor.traffic.schema import MAX_DROPPED, MAX_RECORDS, UnspokenVersion, check_version
from kvcanary.wire import DROPPED_HEADER, GATEWAY_HEADER, RECORDS_HEADER, VERSION_HEADER, partition_of

if TYPE_CHECKING:
    from nats.aio.msg import Msg

_GATEWAY_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


@dataclass(slots=True)
class Pulled(Arrival):
    """One record of a message, decoded, as the pipeline takes it (``key``: its ``id``, unique per
    exchange; one without an id is keyed on its place in the stream, which a redelivery keeps;
    ``dropped`` on a message's first record only), and the gateway its message named."""

    gateway: str = ""


def decode(message: Msg) -> tuple[list[Pulled], int]:
    """Return the message's valid records (a tap batch's share, read as the HTTP ingest reads a
    body), and how many it carried that are not valid (they never will be): for a message that
    is no batch, its ``Kvcanary-Records`` count, at least 1 and at most what its bytes could hold."""
    headers = message.headers or {}
    claimed = max(1, min(_count(headers.get(RECORDS_HEADER, "")), records_carried(message.data)))
    try:
        check_version(_version(headers.get(VERSION_HEADER)), claimed)
        _, valid = read_batch(message.data, versioned=False)
    except UnspokenVersion as refusal:  # another version's prints: never this window's
        REFUSED_VERSIONS.add("nats", refusal)
        return [], claimed
    except ValidationError:  # the envelope itself: nothing in it can be read
        return [], claimed
    records, rejected = valid.records, valid.refused
    gateway = headers.get(GATEWAY_HEADER, "")
    gateway = gateway if _GATEWAY_RE.fullmatch(gateway) else ""
    dropped = min(_count(headers.get(DROPPED_HEADER, "")), MAX_DROPPED)  # as a body's ``dropped``
    seq = message.metadata.sequence.stream
    pulled = [
        # A record without an id is judged once by its place in the stream (a redelivery keeps it).
        Pulled(record, record.id or f"#{seq}.{i}", dropped if i == 0 else 0, gateway)
        for i, record in enumerate(records)
    ]
    return pulled, rejected


def decode_all(messages: list[Msg]) -> list[tuple[list[Pulled], int]]:
    """Return :func:`decode` of each message, in order."""
    return [decode(message) for message in messages]


def records_carried(data: bytes) -> int:
    """Return the most records a message of ``data`` could carry: a batch holds at most
    ``MAX_RECORDS``, and each record takes a byte and its comma at least."""
    return min(MAX_RECORDS, (len(data) + 1) // 2)


def by_partition(pulled: list[Pulled], partition: int, partitions: int) -> tuple[list[Pulled], list[Pulled]]:
    """Split ``pulled`` into the records whose api_base hashes to ``partition`` (the tap's rule) and
    the others, which belong to another partition's window, or to none (a copy published on several)."""
    own: list[Pulled] = []
    others: list[Pulled] = []
    hashed: dict[str, int] = {}  # a pull's records name a few deployments: each hashed once
    for p in pulled:
        api_base = p.record.api_base
        found = hashed.get(api_base)
        if found is None:
            found = hashed[api_base] = partition_of(api_base, partitions)
        (own if found == partition else others).append(p)
    return own, others


def _version(text: str | None) -> int | str | None:
    """A ``Kvcanary-Version`` header's version: the integer it writes in ASCII decimal (at most three
    digits, no leading zero), else the text as sent (no version), or None where there is none."""
    if text is not None and text.isascii() and text.isdigit() and len(text) <= 3 and text[:1] != "0":
        return int(text)
    return text


def _count(text: str) -> int:
    return int(text) if text.isdigit() and len(text) < 12 else 0
