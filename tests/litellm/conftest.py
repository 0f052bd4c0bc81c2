"""Fixtures for the tests against a real LiteLLM proxy with the kvcanary tap (``tests.support.litellm``).

The venv is ``$KVCANARY_LITELLM_VENV`` (or ``.venv-litellm``), made by ``bash
scripts/setup-litellm.sh``. Without it the tests here are skipped, unless
``KVCANARY_REQUIRE_LITELLM=1`` (scripts/test.sh sets it), which turns the skip into a failure.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.monitor.served import served  # noqa: F401 (a fixture: `kvcanary serve` as a process)
from tests.support import PG_HOST, PG_PORT, stop_process
from tests.support.litellm import VENV, Proxy, litellm_migrations, litellm_ready, start_proxy


@pytest.fixture(scope="session", autouse=True)
def _need_litellm() -> None:
    if not litellm_ready():
        message = f"no LiteLLM venv at {VENV}: run bash scripts/setup-litellm.sh"
        if os.environ.get("KVCANARY_REQUIRE_LITELLM") == "1":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture
def litellm_proxy(tmp_path: Path) -> Iterator[Callable[..., Proxy]]:
    """Start proxies: ``litellm_proxy({"model": worker_url}, tap_env)``; each is stopped afterwards."""
    started: list[Proxy] = []

    def start(models: dict[str, str], tap_env: dict[str, str] | None, name: str = "gw", **more: Any) -> Proxy:
        started.append(start_proxy(tmp_path / f"{name}{len(started)}", models, tap_env, **more))
        return started[-1]

    yield start
    for proxy in started:
        stop_process(proxy.proc)


@pytest.fixture
def litellm_db(postgres_url: str) -> Iterator[str]:
    """A PostgreSQL database with LiteLLM's schema, made by its own migrations (its database mode
    cannot start here: Prisma's engines cannot be fetched). Yields a ``postgresql://`` URL."""
    import psycopg

    name = f"litellm_test_{uuid.uuid4().hex[:10]}"
    admin = f"host={PG_HOST} port={PG_PORT} user=postgres dbname=postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        with psycopg.connect(
            f"host={PG_HOST} port={PG_PORT} user=postgres dbname={name}", autocommit=True
        ) as conn:
            for migration in litellm_migrations():
                conn.execute(migration.read_text())
        yield f"postgresql://postgres@{PG_HOST}:{PG_PORT}/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
