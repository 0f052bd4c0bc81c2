"""Fixtures shared by every test: free loopback ports, a real PostgreSQL, reference workers as processes.

Nothing here fakes a server. PostgreSQL is the machine's cluster on 127.0.0.1:5432 (started when
it is down); each test session gets its own throw-away database in it. Workers are started as
real processes with ``python -m workers`` and stopped by PID.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psycopg
import pytest

if TYPE_CHECKING:
    from tests.jetstream import OwnNats, StreamNames

REPO = Path(__file__).resolve().parent.parent
PG_HOST, PG_PORT = "127.0.0.1", int(os.environ.get("KVCANARY_TEST_PG_PORT", "5432"))


@pytest.fixture(scope="session", autouse=True)
def _private_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep every monitor's local state (its spool) inside the test session, processes included."""
    old = os.environ.get("KVCANARY_STATE_DIR")
    os.environ["KVCANARY_STATE_DIR"] = str(tmp_path_factory.mktemp("state"))
    yield
    if old is None:
        os.environ.pop("KVCANARY_STATE_DIR", None)
    else:
        os.environ["KVCANARY_STATE_DIR"] = old


def free_port() -> int:
    """Return a TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll ``url`` until it answers 200; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was ready")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError as exc:
            last = str(exc)
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout}s ({last})")


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


# --- PostgreSQL -------------------------------------------------------------------------------------


def _pg_up() -> bool:
    try:
        with socket.create_connection((PG_HOST, PG_PORT), timeout=1):
            return True
    except OSError:
        return False


def _start_local_pg() -> None:
    """Start the machine's cluster when it is down (Debian: pg_ctlcluster)."""
    if _pg_up() or not shutil.which("pg_ctlcluster"):
        return
    versions = sorted(Path("/etc/postgresql").glob("*"))
    if versions:
        subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1].name, "main", "start"],
            check=False,
            capture_output=True,
            timeout=60,
        )
    for _ in range(50):
        if _pg_up():
            return
        time.sleep(0.2)


@pytest.fixture
def stream_names() -> Iterator[StreamNames]:
    """A stream, bucket and subject prefix of one test's own on the machine's NATS, deleted after it."""
    from tests.jetstream import names_deleted_after  # it imports this module

    yield from names_deleted_after()


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[OwnNats]:
    """A NATS server of one test's own (started by the test), stopped after it."""
    from tests.jetstream import own_server

    yield from own_server(tmp_path / "nats-store")


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database on the real server, dropped at the end of the session."""
    _start_local_pg()
    if not _pg_up():
        pytest.fail(f"PostgreSQL is not reachable on {PG_HOST}:{PG_PORT} and could not be started")
    yield from own_database("kvcanary_test")


def own_database(prefix: str) -> Iterator[str]:
    """Yield the URL of a new database on the machine's server and drop it afterwards (a fixture's
    body: ``yield from own_database("kvcanary_stack")``), for tests whose processes need one to
    themselves. Dropped WITH (FORCE): a replica a test killed may still hold connections."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = f"host={PG_HOST} port={PG_PORT} user=postgres dbname=postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://postgres@{PG_HOST}:{PG_PORT}/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --- reference workers as processes ------------------------------------------------------------------


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
    """Spawn ``python -m workers ARGS`` on ``port`` (default: a free one) without waiting for it."""
    port = port or free_port()
    log = log_dir / f"worker-{port}.log"
    argv = [sys.executable, "-m", "workers", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*argv, *args], stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
        )
    return WorkerProcess(f"http://127.0.0.1:{port}", port, list(args), proc, log)


def wait_worker(worker: WorkerProcess, timeout: float = 90) -> WorkerProcess:
    """Wait for the worker's /health; on failure raise with its log."""
    try:
        wait_http(worker.url + "/health", timeout=timeout, proc=worker.proc)
    except Exception as exc:
        raise RuntimeError(f"worker {worker.args} did not start: {exc}\n{worker.output()}") from exc
    return worker


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start ``python -m workers ARGS`` on a free port; every started worker is stopped afterwards.

    Usage: ``w = start_worker("--mode", "disaggregated", "--admission", "placeholder")``.
    """
    started: list[WorkerProcess] = []

    def start(*args: str, port: int | None = None) -> WorkerProcess:
        worker = launch_worker(list(args), tmp_path, port)
        started.append(worker)
        return wait_worker(worker)

    yield start
    for worker in started:
        worker.stop()


# --- running in parallel (pytest-xdist) ---------------------------------------------------------------

#: Session fixtures that start a server too costly to start once per xdist worker: every test that
#: uses one runs on the same worker, so each server starts once per run.
SHARED_SERVERS = {"vllm_server": "vllm", "llamacpp_servers": "llamacpp"}


# tryfirst: xdist turns the marks into groups in its own hook of this name, on each worker, and
# that hook, registered after this conftest, would otherwise run first and see no mark at all.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep tests that share a costly fixture on one worker under ``--dist loadgroup``.

    A test that uses a module-scoped fixture runs with its module (the fixture is set up once, and
    no two workers build the same thing at once: a wheel, a Prometheus on the module's data); one
    that uses a shared server (``SHARED_SERVERS``) runs with every other user of that server. Every
    other test is handed to whichever worker is free. Without xdist the marks do nothing.
    """
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        defs = fixtures.name2fixturedefs if fixtures is not None else {}
        server = next((SHARED_SERVERS[name] for name in defs if name in SHARED_SERVERS), None)
        scoped = any(d.scope in ("module", "package", "class") for ds in defs.values() for d in ds)
        module = getattr(item, "module", None)  # a Function's; not every Item has one
        group = server or (module.__name__ if scoped and module is not None else None)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
