"""The demo's second and third doors: Prometheus with the project's rules, and Alertmanager.

Started only when the Debian packages are installed (``scripts/demo.sh`` installs them on Debian):
both on free loopback ports, in the demo's workdir, Prometheus scraping the monitor and both
workers and alerting into Alertmanager, which the monitor pages too. Without them the demo runs
on and says what it skipped.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvcanary import monitor
from kvcanary.processes import free_port, stop_processes, wait_http

RULES = Path(monitor.__file__).resolve().parent.parent / "alerts" / "kvcanary.rules.yml"
BINARIES = ("prometheus", "prometheus-alertmanager")


@dataclass
class Observability:
    """Prometheus and Alertmanager as processes of the demo."""

    prometheus_url: str
    alertmanager_url: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def alerts(self, alertname: str) -> list[dict[str, Any]]:
        """Return Alertmanager's active alerts named ``alertname`` ([] when it does not answer)."""
        try:
            response = httpx.get(
                f"{self.alertmanager_url}/api/v2/alerts",
                params={"filter": f'alertname="{alertname}"'},
                timeout=2,
            )
            return list(response.json()) if response.is_success else []
        except (httpx.HTTPError, ValueError):
            return []

    def stop(self) -> None:
        stop_processes(self.procs)


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def start_observability(workdir: Path, monitor_port: int, worker_urls: dict[str, str]) -> Observability:
    """Start Alertmanager, then Prometheus scraping the monitor and the workers; raise when one fails."""
    am_port, prom_port = free_port(), free_port()
    am_conf = workdir / "alertmanager.yml"
    am_conf.write_text(
        yaml.safe_dump(
            {
                "route": {
                    "receiver": "demo",
                    "group_wait": "1s",
                    "group_interval": "5s",
                    "repeat_interval": "1h",
                },
                "receivers": [{"name": "demo"}],  # shown in the UI; no notification leaves this machine
            }
        )
    )
    am = _spawn(
        ["prometheus-alertmanager", f"--config.file={am_conf}", f"--storage.path={workdir / 'am-data'}",
         f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
        workdir / "alertmanager.log",
    )  # fmt: skip
    obs = Observability(f"http://127.0.0.1:{prom_port}", f"http://127.0.0.1:{am_port}", [am])
    try:
        _ready(obs.alertmanager_url, am)
        prom_conf = workdir / "prometheus.yml"
        prom_conf.write_text(yaml.safe_dump(_prometheus_config(monitor_port, worker_urls, am_port)))
        prom = _spawn(
            ["prometheus", f"--config.file={prom_conf}", f"--storage.tsdb.path={workdir / 'prom-data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--rules.alert.resend-delay=1s"],
            workdir / "prometheus.log",
        )  # fmt: skip
        obs.procs.append(prom)
        _ready(obs.prometheus_url, prom)
    except Exception:
        obs.stop()
        raise
    return obs


def _prometheus_config(monitor_port: int, worker_urls: dict[str, str], am_port: int) -> dict[str, Any]:
    workers = [url.removeprefix("http://") for url in worker_urls.values()]
    return {
        "global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
        "rule_files": [str(RULES)],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
        "scrape_configs": [
            {"job_name": "kvcanary", "static_configs": [{"targets": [f"127.0.0.1:{monitor_port}"]}]},
            {"job_name": "kvcanary-workers", "static_configs": [{"targets": workers}]},
        ],
    }


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    wait_http(url + "/-/ready", timeout, proc)
