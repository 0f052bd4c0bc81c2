"""Fixtures shared by every test: a real PostgreSQL, NATS streams, reference workers as processes.

Nothing here fakes a server. PostgreSQL is the machine's cluster on 127.0.0.1:5432 (started when
it is down); each test session gets its own throw-away database in it. Workers are started as
real processes with ``python -m kvcanary.workers`` and stopped by PID. What tests share besides
fixtures is the ``tests.support`` package; nothing is imported from this file.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import hypothesis
import pytest

from tests.support import (
    PG_HOST,
    PG_PORT,
    WorkerProcess,
    launch_worker,
    own_database,
    wait_worker,
)
from tests.support.database import pg_up, start_local_pg

if TYPE_CHECKING:
    from tests.support.jetstream import OwnNats, StreamNames

# Hypothesis's 200 ms deadline per example judges the machine's pace, never the code: beside a second
# run of the suite, one example of a 0.03 ms check took 697 ms. Examples are still bounded in number.
hypothesis.settings.register_profile("kvcanary", deadline=None)
hypothesis.settings.load_profile("kvcanary")


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


@pytest.fixture
def stream_names() -> Iterator[StreamNames]:
    """A stream, bucket and subject prefix of one test's own on the machine's NATS, deleted after it."""
    from tests.support.jetstream import names_deleted_after  # it imports this module

    yield from names_deleted_after()


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[OwnNats]:
    """A NATS server of one test's own (started by the test), stopped after it."""
    from tests.support.jetstream import own_server

    yield from own_server(tmp_path / "nats-store")


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database on the real server, dropped at the end of the session."""
    start_local_pg()
    if not pg_up():
        pytest.fail(f"PostgreSQL is not reachable on {PG_HOST}:{PG_PORT} and could not be started")
    yield from own_database("kvcanary_test")


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start ``python -m kvcanary.workers ARGS`` on a free port; every started worker is stopped afterwards.

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
