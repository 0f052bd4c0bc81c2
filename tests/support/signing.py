"""Keys for the quarantine set's signature, as the tests hand them out: a key pair made by the
real ``kvcanary containment keygen`` code in a test's folder, what a monitor's config and a tap's
environment name of it, and sets signed with it (or with another key: a forger's)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from kvcanary.monitor.containment.key_files import write_key_pair
from kvcanary.monitor.containment.signing import SetSigner, private_key
from kvcanary.tap.containment.document import parse_quarantine
from kvcanary.tap.containment.signed import PublicKeys, open_envelope, parse_public_keys
from kvcanary.wire import GATEWAY_HEADER

SHARED = "http://10.0.0.7:8000"


@dataclass(frozen=True)
class SigningKeys:
    """A key pair in ``folder``: ``private`` the monitors', ``public`` the taps'."""

    private: Path
    public: Path
    key_id: str

    @property
    def signer(self) -> SetSigner:
        return SetSigner(private_key(self.private.read_text()))

    @property
    def public_keys(self) -> PublicKeys:
        """The taps' keys, as a watch takes them."""
        return parse_public_keys(self.public.read_text())

    def monitor_config(self) -> dict[str, Any]:
        """The ``containment_signing`` block of a monitor's config."""
        return {"key_file": str(self.private)}

    def tap_env(self) -> dict[str, str]:
        """What a gateway's environment names of the key."""
        return {"KVCANARY_TAP_QUARANTINE_PUBLIC_KEYS_FILE": str(self.public)}


def make_keys(folder: Path) -> SigningKeys:
    """Write a new key pair into ``folder`` (made if missing)."""
    pair = write_key_pair(folder)
    return SigningKeys(pair.private, pair.public, pair.key_id)


def document(
    *quarantined: str,
    incident: int = 42,
    revision: int = 1,
    generated: datetime | None = None,
    expires_seconds: float = 3600,
) -> dict[str, Any]:
    """A set as the monitor signs it, ``quarantined`` targets each on one deployment (``shared`` on
    ``SHARED``, any other ``t`` on ``http://t:1``)."""
    generated = generated or datetime.now(UTC)
    return {
        "version": 2, "revision": revision, "generated_at": generated.isoformat(),
        "expires_at": (generated + timedelta(seconds=expires_seconds)).isoformat(),
        "deployments": [
            {"target": t, "api_bases": [SHARED if t == "shared" else f"http://{t}:1"], "enforced": True,
             "cause": "incident", "incident_id": incident, "reason": "a leak",
             "since": "2026-12-05T07:00:00Z"}
            for t in quarantined
        ],
        "guards": [],
    }  # fmt: skip


def served_set(url: str, token: str, keys: SigningKeys, gateway: str = "tests") -> dict[str, Any]:
    """The set a monitor at ``url`` serves at ``GET /api/v1/quarantine`` to ``gateway``, its
    signature checked with ``keys`` as a tap checks it (raises if it is not theirs)."""
    headers = {"Authorization": f"Bearer {token}", GATEWAY_HEADER: gateway}
    answer = httpx.get(url + "/api/v1/quarantine", headers=headers)
    for _ in range(30):  # a replica whose guards' pools are not read yet says when to ask again
        if answer.status_code != 503 or "Retry-After" not in answer.headers:
            break
        time.sleep(float(answer.headers["Retry-After"]))
        answer = httpx.get(url + "/api/v1/quarantine", headers=headers)
    assert answer.status_code == 200, answer.text
    payload, signer = open_envelope(answer.content, keys.public_keys)
    assert signer == keys.key_id
    parse_quarantine(payload)  # a tap takes it whole
    found: dict[str, Any] = json.loads(payload)
    return found
