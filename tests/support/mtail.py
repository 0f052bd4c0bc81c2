"""A real mtail (Debian's package) on a log file, running ``alerts/mtail``'s programs: what turns
SGLang's KV canary log lines into the counters a node's ``log_metrics_url`` serves."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvcanary.monitor.targets.scrape import parse_samples
from tests.alerts import ALERTS_DIR, require_tool
from tests.support import free_port, stop_process, wait_http
from tests.support.services import wait_for

PROGRAMS = ALERTS_DIR / "mtail"


@dataclass
class Mtail:
    """mtail tailing ``log``; its page at ``url``."""

    url: str
    log: Path
    proc: subprocess.Popen[bytes]

    def samples(self) -> dict[str, float]:
        return parse_samples(httpx.get(self.url, timeout=5).text)

    def until(self, name: str, value: float, timeout: float = 15) -> None:
        """Wait until mtail's page reads ``value`` for the unlabelled sample ``name``."""
        wait_for(lambda: self.samples().get(name) == value, timeout, f"mtail to read {name} = {value}")

    def until_above(self, name: str, value: float, timeout: float) -> float:
        """Wait until ``name`` reads more than ``value``; return what it reads."""
        wait_for(lambda: self.samples().get(name, 0) > value, timeout, f"mtail to read {name} > {value}")
        return self.samples()[name]


@contextmanager
def running_mtail(log: Path, workdir: Path) -> Iterator[Mtail]:
    """Start mtail on ``log`` (which must exist) on a free loopback port; stop it afterwards. Skips
    without the mtail binary (fails with KVCANARY_REQUIRE_PROMETHEUS=1)."""
    binary = require_tool("mtail", "mtail")
    port = free_port()
    argv = [binary, "--progs", str(PROGRAMS), "--logs", str(log), "--address", "127.0.0.1",
            "--port", str(port), "--logtostderr"]  # fmt: skip
    with (workdir / f"mtail-{port}.out").open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        wait_http(url, timeout=30, proc=proc)
        yield Mtail(url, log, proc)
    finally:
        stop_process(proc)
