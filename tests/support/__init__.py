"""What tests share besides fixtures: one package, imported as ``tests.support`` (fixtures stay in
the ``conftest.py`` files, which import from here and export nothing else).

- ``paths``: the checkout (``REPO``);
- ``database``: the machine's PostgreSQL (``PG_HOST``, ``PG_PORT``, ``own_database``);
- ``workers``: reference workers as processes (``WorkerProcess``, ``launch_worker``, ``wait_worker``);
- ports, waiting and stopping: the monitor's own (``kvcanary.processes``), which
  the demo and the benchmarks use too, re-exported here.
"""

from kvcanary.processes import free_port, stop_process, stop_processes, wait_http
from tests.support.database import PG_HOST, PG_PORT, own_database
from tests.support.paths import REPO
from tests.support.workers import WorkerProcess, launch_worker, wait_worker

__all__ = [
    "PG_HOST",
    "PG_PORT",
    "REPO",
    "WorkerProcess",
    "free_port",
    "launch_worker",
    "own_database",
    "stop_process",
    "stop_processes",
    "wait_http",
    "wait_worker",
]
