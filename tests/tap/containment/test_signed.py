"""Only a set the monitors signed, newer than the one held, moves a tap
(``kvcanary/tap/containment/signed.py``, ``watch.py``): a tap polling a loopback server in the
monitor's place, which serves what a forger would (unsigned, another key's, tampered, an older set
replayed, a frozen one), refuses each value, counts it by reason in the gateway's registry, says so
at most once a minute a reason, and keeps applying the set it took; one that stops moving forward or
expires is still applied, and said. The same over the bucket, against a rogue NATS client:
``test_forged.py``."""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import REGISTRY

from kvcanary.monitor.containment.signing import SetSigner
from kvcanary.tap.containment.document import EMPTY
from kvcanary.tap.containment.signed import Refused, open_envelope, open_set, parse_public_keys
from kvcanary.tap.containment.watch import QuarantineWatch
from kvcanary.wire import api_base_key
from tests.support.loopback import Loopback
from tests.support.signing import SHARED, SigningKeys, document, make_keys


@pytest.fixture
def keys(tmp_path: Path) -> SigningKeys:
    return make_keys(tmp_path / "keys")


class Answers:
    """A loopback server in the monitor's place, answering each read with ``body``; the
    ``Kvcanary-Gateway`` of each read is kept."""

    def __init__(self) -> None:
        self.body = b""
        self.gateways: list[str] = []
        self.server = Loopback(self._answer)
        self.url = self.server.url

    async def _answer(self, request: httpx.Request) -> httpx.Response:
        self.gateways.append(request.headers.get("kvcanary-gateway", ""))
        return httpx.Response(200, content=self.body)


@pytest.fixture
def answers() -> Iterator[Answers]:
    served = Answers()
    yield served
    served.server.close()


def held(watch: QuarantineWatch, api_base: str) -> object:
    """The set's enforced entry for ``api_base``, read without a lookup: a lookup starts the watch's
    own poller (a forked child's first), whose polls would be counted beside the test's."""
    return watch.current.enforced.get(api_base_key(api_base))


def refused_count(reason: str) -> float:
    return REGISTRY.get_sample_value("kvcanary_tap_quarantine_refused_total", {"reason": reason}) or 0.0


def tampered(body: bytes, change: dict[str, Any]) -> bytes:
    """``body``'s envelope with its payload changed and the signature left as it was."""
    envelope = json.loads(body)
    payload = {**json.loads(base64.b64decode(envelope["payload"])), **change}
    return json.dumps(
        {**envelope, "payload": base64.b64encode(json.dumps(payload).encode()).decode()}
    ).encode()


def test_a_forging_server_in_the_monitors_place_moves_no_tap(
    answers: Answers, keys: SigningKeys, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    forger = make_keys(tmp_path / "forger")
    watch = QuarantineWatch(answers.url, "token", keys=keys.public_keys, gateway="gw-7", start=False)
    genuine = keys.signer.sign(document("shared", revision=5))
    answers.body = genuine
    assert watch.poll_once() and held(watch, SHARED) is not None and watch.current.revision == 5
    forged = {
        # a lift of every quarantine, at a revision no monitor will reach
        "unsigned": json.dumps(document(revision=2**53 - 1)).encode(),
        # a healthy target quarantined and the leaking one lifted, one revision above the real one
        "unknown_key": forger.signer.sign(document("healthy", revision=6)),
        "bad_signature": tampered(genuine, {"deployments": [], "revision": 6}),
        "malformed": b"<html>maintenance</html>",
        # the monitors' own set from before the quarantine, replayed
        "older": keys.signer.sign(document(revision=4)),
        # the monitors' own set, past its expiry: a frozen set replayed
        "expired": keys.signer.sign(
            document(revision=6, generated=datetime.now(UTC) - timedelta(hours=2), expires_seconds=60)
        ),
    }
    before = {reason: refused_count(reason) for reason in forged}
    with caplog.at_level(logging.WARNING, "kvcanary.tap"):
        for reason, body in forged.items():
            answers.body = body
            for _ in range(2):
                assert not watch.poll_once(), reason
                assert held(watch, SHARED) is not None and held(watch, "http://healthy:1") is None
            assert watch.refused[reason] == 2, (reason, watch.refused)
            assert refused_count(reason) == before[reason] + 2, reason
    assert watch.current.revision == 5 and watch.current.key_id == keys.key_id and not watch.failing
    said = [r.getMessage() for r in caplog.records if "refused a quarantine set" in r.getMessage()]
    assert len(said) == len(forged), said  # one line a reason, not one a value
    assert all(answers.url in line for line in said) and "no signature" in said[0]
    assert set(answers.gateways) == {"gw-7"}  # each read names the gateway, for the monitor's count
    answers.body = keys.signer.sign(document(revision=6))  # the monitors' next set: taken at once
    assert watch.poll_once() and held(watch, SHARED) is None and watch.current.revision == 6


def test_the_same_set_generated_earlier_changes_nothing_and_another_is_older(keys: SigningKeys) -> None:
    """Two replicas behind one address sign the same set a moment apart: the earlier one is the held
    set again, not a rollback; an earlier one that differs is."""
    now = datetime.now(UTC)

    def opened(*quarantined: str, ago: float, held: Any = EMPTY) -> tuple[Any, bool]:
        body = keys.signer.sign(document(*quarantined, revision=3, generated=now - timedelta(seconds=ago)))
        return open_set(body, keys.public_keys, held, time.time())

    later, _ = opened("shared", ago=0)
    same, moved = opened("shared", ago=5, held=later)
    assert same is later and not moved
    with pytest.raises(Refused) as older:
        opened(ago=5, held=later)
    assert older.value.reason == "older"
    newer, moved = opened(ago=-1, held=later)
    assert moved and newer.empty


def test_a_frozen_set_is_still_applied_and_said_stale_once(
    answers: Answers, keys: SigningKeys, caplog: pytest.LogCaptureFixture
) -> None:
    """The monitors renew their set every minute; a tap fed the last one over and over (a freeze)
    keeps its quarantine, and says it is stale once its newest set is ``stale_seconds`` old."""
    answers.body = keys.signer.sign(document("shared", revision=9))  # never renewed from here on
    watch = QuarantineWatch(answers.url, "token", keys=keys.public_keys, poll_seconds=0.1, stale_seconds=1)
    try:
        with caplog.at_level(logging.WARNING, "kvcanary.tap"):
            time.sleep(0.5)
            assert watch.quarantined(SHARED) is not None and not watch.stale
            deadline = time.monotonic() + 10
            while not watch.stale and time.monotonic() < deadline:
                time.sleep(0.05)
            assert watch.stale and REGISTRY.get_sample_value("kvcanary_tap_quarantine_stale") == 1.0
            time.sleep(0.5)  # polls go on: the line is said once
            assert watch.quarantined(SHARED) is not None  # never lifted for being old
            assert watch.refused.total() == 0  # the same set again is no refusal
            answers.body = keys.signer.sign(document("shared", revision=10))
            deadline = time.monotonic() + 5
            while watch.stale and time.monotonic() < deadline:
                time.sleep(0.05)
        said = [r.getMessage() for r in caplog.records]
        assert sum("is stale" in m for m in said) == 1 and sum("moves forward again" in m for m in said) == 1
        assert not watch.stale and watch.current.revision == 10
    finally:
        watch.close()


def test_a_set_that_expires_in_the_tap_stays_applied_and_a_fresh_tap_refuses_it(
    answers: Answers, keys: SigningKeys
) -> None:
    answers.body = keys.signer.sign(document("shared", revision=2, expires_seconds=1))
    watch = QuarantineWatch(answers.url, "token", keys=keys.public_keys, start=False)
    assert watch.poll_once() and not watch.stale
    time.sleep(1.2)
    watch.check_stale()
    # Expired, still applied (read from memory: a lookup would start the watch's own poller).
    assert watch.stale and watch.current.enforced
    assert not watch.poll_once() and watch.refused["expired"] == 1  # the same bytes again: now refused
    fresh = QuarantineWatch(answers.url, "token", keys=keys.public_keys, start=False)
    assert not fresh.poll_once() and fresh.current.empty and fresh.refused["expired"] == 1


GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "wire" / "quarantine_envelope.json"


def test_the_golden_envelope_is_made_and_opened_byte_for_byte() -> None:
    """What a tap or monitor in another language is checked against (``docs/tap-protocol.md``)."""
    vector = json.loads(GOLDEN.read_text())
    signer = SetSigner(Ed25519PrivateKey.from_private_bytes(bytes.fromhex(vector["seed_hex"])))
    assert (signer.public_key, signer.key_id) == (vector["public_key"], vector["key_id"])
    assert signer.sign(json.loads(vector["payload"])).decode() == vector["envelope"]
    # The bytes signed, spelled out as the protocol does: no library's DSSE in between.
    payload = vector["payload"].encode()
    pae = b"DSSEv1 %d %s %d %s" % (
        len(vector["payload_type"]),
        vector["payload_type"].encode(),
        len(payload),
        payload,
    )
    assert base64.b64decode(vector["pae_base64"]) == pae
    keys = parse_public_keys(vector["public_key"])
    keys[vector["key_id"]].verify(base64.b64decode(vector["signature"]), pae)  # raises if it does not verify
    assert open_envelope(vector["envelope"].encode(), keys) == (payload, vector["key_id"])
    forged = vector["envelope"].replace(vector["signature"][:8], "AAAAAAAA")
    with pytest.raises(Refused, match="bad_signature"):
        open_envelope(forged.encode(), keys)


def test_a_forged_key_id_reaches_the_log_printable(keys: SigningKeys) -> None:
    """A refusal is logged with the ids the value named: a forger's must not start a log line."""
    forged_id = "x\nkvcanary tap: the quarantine is read again"
    envelope = {"payloadType": "application/vnd.kvcanary.quarantine+json", "payload": "e30=",
                "signatures": [{"keyid": forged_id, "sig": "AAAA"}]}  # fmt: skip
    with pytest.raises(Refused) as refused:
        open_envelope(json.dumps(envelope).encode(), keys.public_keys)
    assert refused.value.reason == "unknown_key" and "\n" not in str(refused.value)
