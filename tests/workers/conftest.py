"""Fixtures for the reference worker's tests; helpers and sizes live in ``tests.workers.support``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from kvcanary.workers.server import create_app
from tests.support import WorkerProcess, launch_worker, wait_worker
from tests.workers.support import PLACEHOLDER_FLAGS, small_config

# The in-process engines run many tiny decode steps; one intra-op thread keeps them from stalling on
# a descheduled sibling thread when the machine is busy. Outputs do not depend on it.
torch.set_num_threads(1)


@pytest.fixture
def serve() -> Iterator[Callable[..., TestClient]]:
    """Start an in-process worker (engine thread included) per call: ``client = serve(mode="disaggregated")``.

    The app runs on the tests' small pools (``support.SMALL``) with ``overrides`` applied.
    """
    clients: list[TestClient] = []

    def start(**overrides: Any) -> TestClient:
        client = TestClient(create_app(small_config(**overrides)), raise_server_exceptions=False)
        client.__enter__()
        clients.append(client)
        return client

    yield start
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture(scope="module")
def worker_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProcess]]:
    """Start two real ``python -m kvcanary.workers`` processes at once (their startups overlap) for a module.

    ``healthy``: aggregated mode, default pools. ``defective``: the incident's disaggregated placeholder
    node on the small pools, with keys ``sk-a`` → tenant-a and ``sk-b`` → tenant-b.
    """
    flags = {
        "healthy": ["--mode", "aggregated", "--max-batch", "16"],
        "defective": [*PLACEHOLDER_FLAGS, "--api-key", "sk-a=tenant-a", "--api-key", "sk-b=tenant-b"],
    }
    logs = tmp_path_factory.mktemp("workers")
    workers = {name: launch_worker(args, logs) for name, args in flags.items()}
    try:
        for worker in workers.values():
            wait_worker(worker)
        yield workers
    finally:
        for worker in workers.values():
            worker.stop()
