"""Real servers the tests start and own: a PostgreSQL cluster on its own port, Prometheus, Alertmanager.

Each runs from the Debian packages (``scripts/test.sh`` installs them), binds 127.0.0.1 on a free
port, keeps its data in a folder of its own and is stopped by PID. Nothing here is a fake.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support import free_port, stop_process, wait_http

PG_BIN = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)), Path("/nonexistent"))


def _as_postgres() -> list[str]:
    # initdb and postgres refuse to run as root.
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


@dataclass
class OwnPostgres:
    """A PostgreSQL cluster of the test's own: it can be stopped and started under load."""

    root: Path
    port: int
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.root / "server.log"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _ctl(self, *args: str) -> None:
        subprocess.run(
            [*_as_postgres(), str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", *args],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._ctl("-o", options, "start")

    def stop(self) -> None:
        self._ctl("-m", "fast", "stop")

    @classmethod
    def create(cls) -> OwnPostgres:
        if not (PG_BIN / "initdb").exists():
            raise RuntimeError("PostgreSQL server binaries are missing (apt-get install postgresql)")
        root = Path(tempfile.mkdtemp(prefix="kvcanary-pg-", dir="/tmp"))
        if os.geteuid() == 0:
            shutil.chown(root, "postgres", "postgres")
        server = cls(root, free_port())
        subprocess.run(
            [*_as_postgres(), str(PG_BIN / "initdb"), "-D", str(server.data), "-U", "postgres",
             "--auth=trust", "-E", "UTF8", "--locale=C.UTF-8"],
            check=True,
            capture_output=True,
            timeout=120,
        )  # fmt: skip
        server.start()
        return server

    def destroy(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError):
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


# --- Prometheus and Alertmanager ------------------------------------------------------------------------


@dataclass
class Alertmanager:
    url: str
    proc: subprocess.Popen[bytes]
    root: Path
    port: int

    def alerts(self, **filters: str) -> list[dict[str, Any]]:
        """Return ``GET /api/v2/alerts`` filtered by label equality."""
        params = [("filter", f'{k}="{v}"') for k, v in filters.items()]
        response = httpx.get(self.url + "/api/v2/alerts", params=params, timeout=5)
        response.raise_for_status()
        return list(response.json())

    def stop(self) -> None:
        stop_process(self.proc)


def start_alertmanager(
    root: Path, port: int | None = None, config: dict[str, Any] | None = None
) -> Alertmanager:
    """Start ``prometheus-alertmanager`` on 127.0.0.1 with a config that routes to nowhere."""
    port = port or free_port()
    root.mkdir(parents=True, exist_ok=True)
    conf = root / "alertmanager.yml"
    conf.write_text(yaml.safe_dump(config or {
        "route": {"receiver": "null", "group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"},
        "receivers": [{"name": "null"}],
    }))  # fmt: skip
    url, proc = _serve(
        ["prometheus-alertmanager", f"--config.file={conf}", f"--storage.path={root / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        root / "alertmanager.log", port,
    )  # fmt: skip
    return Alertmanager(url, proc, root, port)


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]
    root: Path

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Return the instant vector (or scalar as one sample) of ``expr``; raise on a PromQL error."""
        response = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        body = response.json()
        if body.get("status") != "success":
            raise AssertionError(f"PromQL error for {expr!r}: {body.get('error')}")
        data = body["data"]
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def alerts(self) -> list[dict[str, Any]]:
        return list(httpx.get(self.url + "/api/v1/alerts", timeout=5).json()["data"]["alerts"])

    def targets_up(self) -> dict[str, str]:
        data = httpx.get(self.url + "/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        return {t["scrapeUrl"]: t["health"] for t in data}

    def stop(self) -> None:
        stop_process(self.proc)


def start_prometheus(
    root: Path,
    scrape: dict[str, list[str]],
    *,
    rule_files: list[Path] = (),  # type: ignore[assignment]
    alertmanager: str | None = None,
    interval: str = "1s",
) -> Prometheus:
    """Start Prometheus scraping ``{job: [host:port, ...]}`` every ``interval``, with ``rule_files``."""
    port = free_port()
    root.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": hosts}]} for job, hosts in scrape.items()
        ],
    }
    if alertmanager:
        host = alertmanager.removeprefix("http://")
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [host]}]}]}
    conf = root / "prometheus.yml"
    conf.write_text(yaml.safe_dump(config))
    url, proc = _serve(
        ["prometheus", f"--config.file={conf}", f"--storage.tsdb.path={root / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--rules.alert.resend-delay=1s", "--web.enable-lifecycle"],
        root / "prometheus.log", port,
    )  # fmt: skip
    return Prometheus(url, proc, root)


def _serve(argv: list[str], log: Path, port: int) -> tuple[str, subprocess.Popen[bytes]]:
    """Start ``argv`` in its own process group, logging to ``log``; return its URL once ``/-/ready``."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/-/ready", timeout=30, proc=proc)
    return url, proc


def wait_for(predicate: Any, timeout: float, what: str, every: float = 0.25) -> Any:
    """Poll ``predicate()`` until it returns something truthy; return it, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
