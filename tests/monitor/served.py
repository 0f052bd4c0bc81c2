"""`kvcanary serve` as a real process, for the tests of how it behaves when the world misbehaves.

:class:`Served` writes the config file, starts the process with a token, and reads its API, its
``/metrics`` and its log; every test stops it, failed or not.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.probes.probe_harness import KEYS
from tests.support import REPO, free_port, stop_process, wait_http


def spawn_serve(config: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start ``kvcanary serve --config CONFIG`` in its own session, appending its output to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "monitor", "serve", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )


def reference_target(name: str, url: str, **fields: Any) -> dict[str, Any]:
    """A target block for an engine that answers like the reference worker, as alice and bob."""
    tenants = [{"name": t, "api_key_env": f"KVC_KEY_{t.upper()}"} for t in ("alice", "bob")]
    return {
        "name": name,
        "base_url": url,
        "engine": "reference",
        "model": "kvcanary-reference",
        "tenants": tenants,
        **fields,
    }


class Served:
    """One ``kvcanary serve`` process with its config (``config``), token and log."""

    def __init__(self, tmp: Path, config: dict[str, Any]):
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = secrets.token_urlsafe(24)
        self.config_path = tmp / "kvcanary.yml"
        self.log_path = tmp / f"monitor-{self.port}.log"
        self.config: dict[str, Any] = {
            "database_url": f"sqlite:///{tmp / 'kvcanary.db'}",
            "spool": {"path": str(tmp / "spool")},
            **config,
            "api": {"listen": f"127.0.0.1:{self.port}", **config.get("api", {})},
        }
        self.env = {
            **os.environ,
            "KVCANARY_API_TOKEN": self.token,
            **{f"KVC_KEY_{t.upper()}": k for t, k in KEYS.items()},
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def write_config(self, config: dict[str, Any] | None = None, text: str | None = None) -> None:
        if config is not None:
            self.config = config
        self.config_path.write_text(text if text is not None else yaml.safe_dump(self.config))

    def kvcanary(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "monitor", *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=self.env,
            timeout=timeout,
        )

    def migrate(self) -> None:
        self.write_config()
        done = self.kvcanary("db", "upgrade", "--config", str(self.config_path))
        assert done.returncode == 0, done.stderr

    def start(self, *, migrate: bool = True, wait: bool = True) -> Served:
        if migrate:
            self.migrate()
        else:
            self.write_config()
        self.proc = spawn_serve(self.config_path, self.env, self.log_path)
        if wait:
            # Readiness judges nothing (a serve that exits is seen at once): room for a machine
            # loaded by two suites (60 s ran out there, with the process still starting).
            wait_http(self.url + "/healthz", timeout=120, proc=self.proc)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def signal(self, sig: signal.Signals = signal.SIGHUP) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def get(self, path: str, *, token: str | None = None, **params: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token or self.token}"}
        return httpx.get(self.url + path, params=params, headers=headers, timeout=10)

    def post(self, path: str, *, token: str | None = None, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token or self.token}"}
        return httpx.post(self.url + path, headers=headers, timeout=30, **kw)

    def samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        """Return every sample of metric ``name`` on ``/metrics`` as (labels, value)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return [
            (s.labels, s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == name
        ]

    def value(self, name: str, **labels: str) -> float | None:
        found = [v for got, v in self.samples(name) if all(got.get(k) == w for k, w in labels.items())]
        return sum(found) if found else None

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if value := check():
                return value
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {what}\n--- monitor log ---\n{self.log()[-4000:]}")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Callable[[dict[str, Any]], Served]]:
    """Make :class:`Served` monitors (not started); each is stopped after the test."""
    made: list[Served] = []

    def make(config: dict[str, Any], where: Path | None = None) -> Served:
        directory = where or tmp_path / f"m{len(made)}"
        directory.mkdir(parents=True, exist_ok=True)
        made.append(Served(directory, config))
        return made[-1]

    yield make
    for monitor in made:
        monitor.stop()
