"""Reference workers as real processes: ``python -m kvcanary.workers ARGS`` on a loopback port."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvcanary.processes import free_port, stop_process, wait_http
from tests.support.paths import REPO


@dataclass
class WorkerProcess:
    url: str
    port: int
    args: list[str]
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        stop_process(self.proc)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def launch_worker(args: list[str], log_dir: Path, port: int | None = None) -> WorkerProcess:
    """Spawn ``python -m kvcanary.workers ARGS`` on ``port`` (default: a free one) without waiting for it."""
    port = port or free_port()
    log = log_dir / f"worker-{port}.log"
    argv = [sys.executable, "-m", "kvcanary.workers", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*argv, "--device", "cpu", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )
    return WorkerProcess(f"http://127.0.0.1:{port}", port, list(args), proc, log)


def wait_worker(worker: WorkerProcess, timeout: float = 90) -> WorkerProcess:
    """Wait for the worker's /health; on failure raise with its log."""
    try:
        wait_http(worker.url + "/health", timeout=timeout, proc=worker.proc)
    except Exception as exc:
        raise RuntimeError(f"worker {worker.args} did not start: {exc}\n{worker.output()}") from exc
    return worker
