"""The marker key: replicas and a restarted monitor must recognise each other's markers.

A marker is sealed by a MAC under the key; a process with another key sees an unrelated string.
Two fresh interpreters stand in for two replicas (or one monitor before and after a restart).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcanary.monitor.app import Monitor
from kvcanary.monitor.config.secrets import marker_key
from kvcanary.monitor.config.settings import ConfigError, parse_settings
from kvcanary.monitor.storage.db import upgrade
from tests.support import REPO
from tests.support.pace import PROCESS_SECONDS

TOKEN = "replica-token-0123456789abcdef"
KEY = "k" * 40

PLANT = """
from kvcanary.monitor.config.settings import parse_settings
from kvcanary.monitor.config.secrets import api_token, marker_key
from kvcanary.probes.markers import MarkerBook
s = parse_settings({})
book = MarkerBook(key=marker_key(s, api_token(s)))
print(book.plant("glm", "alice")[1])
"""
SCAN = """
import sys
from kvcanary.monitor.config.settings import parse_settings
from kvcanary.monitor.config.secrets import api_token, marker_key
from kvcanary.probes.markers import MarkerBook
s = parse_settings({})
book = MarkerBook(key=marker_key(s, api_token(s)))
book.register("glm", "alice")
hits = book.scan("stale page: " + sys.argv[1], target="glm", reader="bob")
print(",".join(f"{h.owner_target}/{h.owner_tenant}" for h in hits))
"""


def in_a_new_process(code: str, env: dict[str, str], *args: str) -> str:
    run = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=PROCESS_SECONDS, check=True)  # fmt: skip
    return run.stdout.strip()


@pytest.mark.parametrize("secret", [{"KVCANARY_MARKER_KEY": KEY}, {}], ids=["stated key", "from the token"])
def test_a_marker_planted_by_one_process_is_a_leak_to_another(secret: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVCANARY_MARKER_KEY"}
    env.update(KVCANARY_API_TOKEN=TOKEN, **secret)
    marker = in_a_new_process(PLANT, env)
    assert in_a_new_process(SCAN, env, marker) == "glm/alice"
    # Another monitor (another token, no shared key) sees an unrelated string.
    env["KVCANARY_API_TOKEN"] = "another-token-0123456789abcdef"
    if not secret:
        assert in_a_new_process(SCAN, env, marker) == ""


def test_the_key_is_stated_derived_or_none(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVCANARY_MARKER_KEY", raising=False)
    settings = parse_settings({})
    assert marker_key(settings, None) is None  # a local process without a token: its own random key
    derived = marker_key(settings, TOKEN)
    assert derived is not None and derived == marker_key(settings, TOKEN) != marker_key(settings, TOKEN + "x")
    monkeypatch.setenv("KVCANARY_MARKER_KEY", KEY)
    stated = marker_key(settings, TOKEN)
    assert stated is not None and stated != derived and stated == marker_key(settings, None)
    (tmp_path / "key").write_text(KEY + "\n")
    from_file = marker_key(parse_settings({"marker_key_file": str(tmp_path / "key")}), TOKEN)
    assert from_file == stated
    monkeypatch.setenv("KVCANARY_MARKER_KEY", "short")
    with pytest.raises(ConfigError, match="marker_key_env"):
        marker_key(settings, TOKEN)


def test_two_monitors_with_one_token_read_each_others_markers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service wires the shared key in: two Monitors (two replicas, or before and after a restart)."""
    monkeypatch.delenv("KVCANARY_MARKER_KEY", raising=False)
    monkeypatch.setenv("KVCANARY_API_TOKEN", TOKEN)
    target = {"name": "glm", "base_url": "http://127.0.0.1:9", "engine": "reference",
              "tenants": [{"name": "alice"}, {"name": "bob"}], "probes": ["canary"]}  # fmt: skip
    monitors = []
    for name in ("one", "two"):
        url = f"sqlite:///{tmp_path / name}.db"
        upgrade(url)
        monitors.append(Monitor.open(parse_settings({"database_url": url, "spool": {"in_memory": True},
                                                "targets": [target]})))  # fmt: skip
    _, marker = monitors[0].markers.plant("glm", "alice")
    (hit,) = monitors[1].markers.scan(f"...{marker}...", target="glm", reader="bob")
    assert (hit.owner_target, hit.owner_tenant) == ("glm", "alice")
