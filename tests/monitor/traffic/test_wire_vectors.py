"""The monitor's side of the protocol's golden vectors (``tests/fixtures/wire/``): every batch body,
NATS message and record a conforming tap makes of the vectors' inputs is read by the monitor's own
readers (``monitor/traffic/schema.py``, ``messages.py``) as the records it holds, and a batch or
message of another version is refused and counted. The taps are held to the same files
(``tests/tap/test_wire_golden.py``, ``taps/node``): so the two sides meet on the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from nats.aio.msg import Msg

from kvcanary import wire
from kvcanary.monitor.metrics.versions import REFUSED_VERSIONS
from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.monitor.traffic.messages import by_partition, decode
from kvcanary.monitor.traffic.reading import read_batch
from kvcanary.monitor.traffic.schema import UnspokenVersion

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "wire"


def load(name: str) -> dict[str, Any]:
    vectors: dict[str, Any] = json.loads((FIXTURES / name).read_text(encoding="utf-8"))
    assert vectors["version"] == wire.VERSION
    return vectors


def message(subject: str, payload: bytes, headers: dict[str, str], seq: int = 1) -> Msg:
    """A message as nats-py hands a pulled JetStream message to the consumer: its reply subject
    is JetStream's acknowledgement subject, which carries the stream sequence."""
    reply = f"$JS.ACK.KVCANARY_TRAFFIC.kvcanary-p0.1.{seq}.{seq}.1767225600000000000.0"
    return Msg(_client=None, subject=subject, reply=reply, data=payload, headers=dict(headers))  # type: ignore[arg-type]


def judged(record: dict[str, Any]) -> dict[str, Any]:
    """A record as the monitor holds it once read."""
    return TrafficRecord.model_validate(record).model_dump()


def test_the_monitor_reads_every_message_of_the_vectors_as_the_records_the_batch_held() -> None:
    for case in load("framing.json")["messages"]:
        records = case["records"]
        for i, m in enumerate(case["messages"]):
            pulled, rejected = decode(
                message(m["subject"], m["payload"].encode("ascii"), m["headers"], i + 1)
            )
            count = int(m["headers"][wire.RECORDS_HEADER])
            assert rejected == 0 and len(pulled) == count, case["name"]
            partition = int(m["subject"].rsplit(".", 1)[1])
            own, others = by_partition(pulled, partition, case["partitions"])
            assert others == [] and len(own) == count  # every record on its own partition
            expected = [
                r for r in records if wire.partition_of(r["api_base"], case["partitions"]) == partition
            ]
            start = [r["id"] for r in expected].index(pulled[0].record.id)
            assert [p.record.model_dump() for p in pulled] == [
                judged(r) for r in expected[start : start + count]
            ]
            assert pulled[0].dropped == (case["dropped"] if i == 0 else 0)
            assert {p.gateway for p in pulled} == {case["gateway"]}


def test_the_monitor_reads_every_body_and_every_exchanges_record_of_the_vectors() -> None:
    for body in load("framing.json")["bodies"]:
        envelope, valid = read_batch(body["body"].encode("ascii"))
        assert (envelope.version, envelope.batch, envelope.dropped) == (4, body["batch_id"], body["dropped"])
        assert [r.model_dump() for r in valid.records] == [judged(r) for r in body["records"]]
    exchanges = load("exchanges.json")["exchanges"]
    encoded = [case["encoded"].encode("ascii") for case in exchanges]
    _, valid = read_batch(wire.batch_body("ab" * 16, "gw-1", 0, encoded))
    assert valid.refused == 0 and len(valid.records) == len(exchanges)
    for case, record in zip(exchanges, valid.records, strict=True):
        # What a conforming tap sends is kept as sent: its names are printable already.
        assert record.model_dump() == judged(case["record"]), case["name"]
        assert record.caller == case["record"]["caller"] and record.model == case["record"]["model"]


@pytest.mark.parametrize(
    ("version", "label"),
    [(None, "none"), (3, "3"), (5, "5"), ("4", "other"), (4.0, "other"), (True, "other")],
)
def test_a_batch_of_another_version_or_none_is_refused_whole_naming_the_versions_spoken(
    version: object, label: str
) -> None:
    body: dict[str, Any] = {
        "gateway": "gw-1",
        "records": [{"id": "r", "time": 1, "api_base": "x", "status": 200}] * 3,
    }
    if version is not None:
        body["version"] = version
    for raw in (json.dumps(body).encode(), json.dumps({**body, "gateway": "bad name!"}).encode()):
        with pytest.raises(UnspokenVersion) as refused:
            read_batch(raw)
        assert (refused.value.version, refused.value.records) == (label, 3)
        assert "speaks version 4" in str(refused.value)


def test_a_message_of_another_version_or_none_is_counted_refused_and_never_read() -> None:
    m = load("framing.json")["messages"][0]["messages"][0]
    count = int(m["headers"][wire.RECORDS_HEADER])
    for header, label in ((None, "none"), ("3", "3"), ("04", "other"), ("٤", "other")):
        headers = {k: v for k, v in m["headers"].items() if k != wire.VERSION_HEADER}
        if header is not None:
            headers[wire.VERSION_HEADER] = header
        before = REFUSED_VERSIONS.counts().get(("nats", label), 0)
        assert decode(message(m["subject"], m["payload"].encode(), headers)) == ([], count)
        assert REFUSED_VERSIONS.counts()[("nats", label)] == before + count
    assert len(decode(message(m["subject"], m["payload"].encode(), m["headers"]))[0]) == count
