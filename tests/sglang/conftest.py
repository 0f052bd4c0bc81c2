"""The ``sglang_server`` fixture: the SGLang engine itself (0.5.23, on this CPU) once per session.

How it is started, and what a test gets, is ``tests/sglang/server.py``. Unless KVCANARY_SGLANG_VENV
names a venv built by ``bash scripts/setup-sglang.sh`` the tests here are skipped (failed, with
KVCANARY_REQUIRE_SGLANG=1). Every test module here marks itself ``xdist_group("sglang")`` and uses
session fixtures only, so that under xdist one worker starts the one server.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.sglang.server import SglangServer, make_model, python_of_a_built_venv, start_server
from tests.support import stop_process


@pytest.fixture(scope="session")
def sglang_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglangServer]:
    """Start SGLang on the tiny model once per session; stop its process group afterwards."""
    python = python_of_a_built_venv()
    make_model(python)
    started = time.monotonic()
    server, proc, failure = start_server(python, tmp_path_factory.mktemp("sglang"))
    if proc is None:
        pytest.fail(f"SGLang did not start.\n{failure}")
    print(f"SGLang ready in {time.monotonic() - started:.1f} s at {server.url}")
    try:
        yield server
    finally:
        stop_process(proc, timeout=30)
