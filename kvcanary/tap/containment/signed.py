"""The quarantine set as only the monitors can write it: a tap takes a set the monitors signed, and
newer than the one it holds, or nothing (``docs/tap-protocol.md``, "Quarantine").

The set travels in a DSSE envelope, ``{"payloadType", "payload", "signatures": [{"keyid", "sig"}]}``:
``payload`` the document's exact bytes in base64, each ``sig`` an Ed25519 signature (base64) over
:func:`kvcanary.wire.envelope_pae` of the payload type and those bytes, ``keyid``
:func:`kvcanary.wire.key_id` of the key. The bytes signed are the bytes read, so no JSON is ever
re-encoded to be checked, in any language. The monitors hold the private key; a tap holds only
public keys (``KVCANARY_TAP_QUARANTINE_PUBLIC_KEYS``, several while keys rotate), so no tap host,
and nothing else that can write the bucket or answer in the monitor's place, can make a set a tap
takes.

:func:`open_set` refuses, with the reason the gateway counts (``REASONS``):

- ``malformed``: not an envelope, or a payload that is not the document's shape;
- ``unsigned``: a JSON object with no signature (a set as taps before version 2 read it);
- ``unknown_key``: signed only by keys this tap does not hold;
- ``bad_signature``: a key it holds does not verify the signature (the payload was changed);
- ``expired``: signed, but past its ``expires_at``: a frozen set replayed;
- ``older``: signed, but older than the set held (a lower ``revision``, or the same revision
  generated earlier with other contents): a rollback replayed.

Ed25519 is ``cryptography``'s, which LiteLLM's proxy installs already; it is imported only where
a tap quarantines.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import re
from typing import TYPE_CHECKING

from kvcanary.tap.containment.document import QuarantineSet, parse_quarantine
from kvcanary.tap.record import printable_name
from kvcanary.wire import QUARANTINE_PAYLOAD_TYPE, envelope_pae, key_id

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

#: Why a value was refused: the gateway's counter's ``reason`` label.
REASONS = ("unsigned", "bad_signature", "unknown_key", "malformed", "older", "expired")
#: Signatures of one envelope looked at, at most: a value cannot make a tap verify without end.
MAX_SIGNATURES = 8
#: An Ed25519 public key: 32 bytes, 44 characters of base64.
PUBLIC_KEY_BYTES = 32

PublicKeys = dict[str, "Ed25519PublicKey"]


class Refused(ValueError):
    """A value that is not a set the monitors signed, or not newer than the one held; ``reason``
    is one of ``REASONS``."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def parse_public_keys(text: str) -> PublicKeys:
    """Return the Ed25519 public keys in ``text`` by key id: each the base64 of its 32 raw bytes
    (what ``kvcanary containment keygen`` writes), separated by white space or commas, ``#`` to the
    end of a line a comment. Raise ValueError saying what is wrong (no key at all included), or
    ImportError without ``cryptography``."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    keys: PublicKeys = {}
    for word in re.split(r"[\s,]+", re.sub(r"#[^\n]*", "", text)):
        if not word:
            continue
        try:
            raw = base64.b64decode(word, validate=True)
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) != PUBLIC_KEY_BYTES:
            raise ValueError(f"{word[:12]!r}... is not an Ed25519 public key (base64 of 32 bytes)")
        keys[key_id(raw)] = Ed25519PublicKey.from_public_bytes(raw)
    if not keys:
        raise ValueError("no public key in it")
    return keys


def open_envelope(body: bytes, keys: PublicKeys) -> tuple[bytes, str]:
    """Return the payload of a signed envelope and the id of the key whose signature verifies it;
    raise :class:`Refused` (``malformed``, ``unsigned``, ``unknown_key``, ``bad_signature``)."""
    from cryptography.exceptions import InvalidSignature

    try:
        envelope = json.loads(body)
    except ValueError:
        raise Refused("malformed", "not JSON") from None
    if not isinstance(envelope, dict):
        raise Refused("malformed", "not a JSON object")
    signatures = envelope.get("signatures")
    if not signatures:
        raise Refused("unsigned", "no signature")
    payload_type, text = envelope.get("payloadType"), envelope.get("payload")
    if (
        not isinstance(signatures, list)
        or payload_type != QUARANTINE_PAYLOAD_TYPE
        or not isinstance(text, str)
    ):
        raise Refused("malformed", f"not a signed quarantine set ({QUARANTINE_PAYLOAD_TYPE})")
    payload = _base64(text, "payload")
    signed = envelope_pae(payload_type, payload)
    failed = []
    for item in signatures[:MAX_SIGNATURES]:
        if not isinstance(item, dict) or not all(isinstance(item.get(k), str) for k in ("keyid", "sig")):
            raise Refused("malformed", "a signature is not {keyid, sig}")
        key = keys.get(item["keyid"])
        if key is None:
            continue
        try:
            key.verify(_base64(item["sig"], "sig"), signed)
        except InvalidSignature:
            failed.append(item["keyid"])
            continue
        return payload, item["keyid"]
    if failed:
        raise Refused("bad_signature", f"key {failed[0]} does not verify it")
    # The ids are the value's own: made printable before they reach a log line.
    named = ", ".join(printable_name(item["keyid"])[:16] for item in signatures[:3])
    raise Refused("unknown_key", f"signed by no key this tap holds ({named})")


def open_set(body: bytes, keys: PublicKeys, held: QuarantineSet, now: float) -> tuple[QuarantineSet, bool]:
    """Return the set a value holds and whether it moves the tap forward (True: take it; False: it
    is the set held again, or the same set generated earlier, and changes nothing); raise
    :class:`Refused` for a value the monitors did not sign, one expired at ``now`` (epoch
    seconds), or one older than ``held``."""
    payload, signer = open_envelope(body, keys)
    try:
        found = dataclasses.replace(parse_quarantine(payload), key_id=signer)
    except ValueError as exc:
        raise Refused("malformed", str(exc)) from None
    if found.expires <= now:
        raise Refused("expired", f"revision {found.revision} expired at {found.expires_at}")
    if (found.revision, found.generated) > (held.revision, held.generated):
        return found, True
    if found.revision == held.revision and found.same_content(held):
        # Two replicas' copies of one set, or the held one delivered again: nothing goes back.
        return held, False
    raise Refused(
        "older", f"revision {found.revision} of {found.generated_at}, older than the {held.revision} held"
    )


def _base64(text: str, name: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise Refused("malformed", f"'{name}' is not base64") from None


def describe(found: QuarantineSet) -> str:
    """Return ``revision R, generated T, key K``: how logs name a set."""
    return f"revision {found.revision}, generated {found.generated_at}, key {found.key_id}"
