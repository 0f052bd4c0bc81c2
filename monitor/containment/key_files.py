"""The signing key pair as files an operator rolls out (``kvcanary containment keygen``; how to roll
one out and rotate it: ``docs/operating.md``).

``quarantine-signing.key`` is the monitors' private key (PEM, PKCS#8, readable by its owner only:
``containment_signing.key_file``), ``quarantine-signing.pub`` the public key the gateways' taps hold
(``KVCANARY_TAP_QUARANTINE_PUBLIC_KEYS_FILE``), one line of base64 with its key id in a comment. An
existing file is never overwritten: a key replaced by mistake would make every tap refuse the
monitors' sets.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from pathlib import Path

from kvcanary.monitor.containment.signing import new_key
from kvcanary.wire import key_id

PRIVATE_NAME = "quarantine-signing.key"
PUBLIC_NAME = "quarantine-signing.pub"


@dataclass(frozen=True)
class KeyPair:
    private: Path
    public: Path
    key_id: str


class KeyExists(FileExistsError):
    """A key file is there already; nothing was written."""


def write_key_pair(folder: Path) -> KeyPair:
    """Write a new key pair into ``folder`` (made if missing); raise :class:`KeyExists` naming a
    file already there (nothing is written then)."""
    folder.mkdir(parents=True, exist_ok=True)
    private, public = folder / PRIVATE_NAME, folder / PUBLIC_NAME
    for path in (private, public):
        if path.exists():
            raise KeyExists(f"{path} exists; move it away first (a key replaced by mistake locks taps out)")
    pem, public_key = new_key()
    made = key_id(base64.b64decode(public_key))
    # Made readable by its owner alone before the key is in it.
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(pem)
    public.write_text(f"# kvcanary quarantine set, key {made}\n{public_key}\n")
    return KeyPair(private, public, made)
