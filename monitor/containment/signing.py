"""The quarantine set signed by the monitors, so that only they can move a gateway.

Whoever can write the JetStream KV bucket (a tap host, on a NATS without permissions) or answer in
a monitor's place over HTTP could otherwise lift every quarantine or impose one. So the set travels
in a DSSE envelope (``kvcanary/tap/containment/signed.py``, ``docs/tap-protocol.md``): the
document's exact bytes, and an Ed25519 signature over them by the monitors' private key. The taps
hold only the public key (``KVCANARY_TAP_QUARANTINE_PUBLIC_KEYS``): none of them can sign.

:class:`SetSigner` holds this monitor's private key (``containment_signing.key_file`` or
``key_env``: a PEM PKCS#8 key or the base64 of its 32-byte seed, what ``kvcanary containment
keygen`` writes) and the public keys whose sets are the monitors' (its own, and those of
``public_keys_file`` or ``public_keys_env``: another replica's while keys rotate). The key is never
logged, stored or returned; a message about it names the setting, never its value.

:func:`signer_of` reads them, and raises ``ConfigError`` naming the key where one is missing or
unusable while it is needed: while any target's containment mode is ``quarantine`` or its
admission guard is on (both move customers). Under the ``observe`` default with no guard a monitor
without a key serves no set (the taps read nothing and say so), and says why once.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvcanary.monitor.config.secrets import read_secret
from kvcanary.monitor.config.settings import ConfigError, Settings
from kvcanary.tap.containment.document import QuarantineSet, parse_quarantine
from kvcanary.tap.containment.signed import PublicKeys, Refused, open_envelope, parse_public_keys
from kvcanary.wire import QUARANTINE_PAYLOAD_TYPE, envelope_pae, key_id

SEED_BYTES = 32


class SetSigner:
    """Signs this monitor's sets and opens those the bucket holds (module doc)."""

    def __init__(self, private: Ed25519PrivateKey, trusted: PublicKeys | None = None):
        """``trusted``: public keys besides this one's whose sets are the monitors'."""
        self._private = private
        public = private.public_key()
        raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        #: The id of the key that signs (``kvcanary.wire.key_id``), what the taps' logs name.
        self.key_id = key_id(raw)
        #: The public key, as the taps hold it (base64 of its 32 bytes).
        self.public_key = base64.b64encode(raw).decode()
        self.trusted: PublicKeys = {**(trusted or {}), self.key_id: public}

    def sign(self, document: dict[str, Any]) -> bytes:
        """Return ``document`` as a signed envelope's bytes: its JSON (compact, as it is sent) in
        base64, and this key's signature over it."""
        payload = json.dumps(document, separators=(",", ":")).encode()
        signature = self._private.sign(envelope_pae(QUARANTINE_PAYLOAD_TYPE, payload))
        envelope = {
            "payloadType": QUARANTINE_PAYLOAD_TYPE,
            "payload": base64.b64encode(payload).decode(),
            "signatures": [{"keyid": self.key_id, "sig": base64.b64encode(signature).decode()}],
        }
        return json.dumps(envelope, separators=(",", ":")).encode()

    def open(self, body: bytes) -> tuple[dict[str, Any], QuarantineSet]:
        """Return a value the monitors signed as its document and as a tap reads it (its revision,
        times and signer); raise :class:`Refused` for one they did not sign or not a set."""
        payload, signer = open_envelope(body, self.trusted)
        try:
            read = parse_quarantine(payload)
        except ValueError as exc:
            raise Refused("malformed", str(exc)) from None
        document = json.loads(payload)
        return document, dataclasses.replace(read, key_id=signer)


def needs_key(settings: Settings) -> str | None:
    """Return why ``settings`` need a signing key (a target that moves customers), else None."""
    for target in settings.targets:
        policy = settings.containment_of(target)
        if policy.mode == "quarantine":
            return f"target {target.name}'s containment mode is quarantine"
        if policy.admission_guard != "off":
            return f"target {target.name}'s admission guard is {policy.admission_guard}"
    return None


def signer_of(settings: Settings) -> SetSigner | None:
    """Return the signer of ``settings`` (None: no key and none needed); raise ConfigError naming
    the setting whose key is missing or unusable (module doc)."""
    cfg = settings.containment_signing
    text = read_secret(env=cfg.key_env, file=cfg.key_file, key="containment_signing.key_file")
    if text is None:
        if (why := needs_key(settings)) is None:
            return None
        raise ConfigError(
            f"containment_signing.key_env: set {cfg.key_env} (or containment_signing.key_file) to the "
            f"monitors' private key for the quarantine set (kvcanary containment keygen): {why}, and "
            "the gateways take only a set the monitors signed"
        )
    where = "containment_signing.key_file" if cfg.key_file is not None else "containment_signing.key_env"
    try:
        private = private_key(text)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    trusted_text = read_secret(
        env=cfg.public_keys_env, file=cfg.public_keys_file, key="containment_signing.public_keys_file"
    )
    trusted: PublicKeys = {}
    if trusted_text is not None:
        where = "containment_signing.public_keys_" + ("file" if cfg.public_keys_file else "env")
        try:
            trusted = parse_public_keys(trusted_text)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return SetSigner(private, trusted)


def private_key(text: str) -> Ed25519PrivateKey:
    """Return the Ed25519 private key ``text`` holds: PEM (PKCS#8) or the base64 of its 32-byte
    seed; raise ValueError saying what is wrong, never quoting the key."""
    if text.lstrip().startswith("-----BEGIN"):
        try:
            key = serialization.load_pem_private_key(text.encode(), password=None)
        except (ValueError, TypeError):
            raise ValueError("not a PEM private key without a password") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError("the PEM key is not an Ed25519 key")
        return key
    try:
        seed = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        seed = b""
    if len(seed) != SEED_BYTES:
        raise ValueError("not an Ed25519 private key (PEM, or the base64 of its 32-byte seed)")
    return Ed25519PrivateKey.from_private_bytes(seed)


def new_key() -> tuple[bytes, str]:
    """Return a new key pair: the private key as PEM (PKCS#8) and the public key as the taps hold
    it (base64 of its 32 bytes)."""
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return pem, SetSigner(private).public_key
