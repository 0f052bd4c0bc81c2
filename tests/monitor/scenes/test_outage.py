"""PostgreSQL restarted under load: `kvcanary serve` loses no verdict and keeps its alerts up.

On main before the spool, 60 s of database outage dropped 68 verdicts (11 of them leaks) and
``kvcanary_incidents_open`` vanished. Here a PostgreSQL cluster of the test's own is stopped while
the monitor probes a defective and a healthy reference worker every second, then started again.
Every verdict the monitor logged must be in the database afterwards, exactly once.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, text

from tests.monitor.scenes.test_e2e import Deployment
from tests.support import WorkerProcess, stop_process
from tests.support.services import OwnPostgres

pytestmark = [pytest.mark.external_service, pytest.mark.slow]

VERDICT_LINE = re.compile(
    r" INFO kvcanary\.runner: ([\w.-]+)/(\w+)(?:@[\w.-]+)?: (pass|leak|mismatch|error) "
)


@pytest.fixture
def own_postgres() -> Iterator[OwnPostgres]:
    server = OwnPostgres.create()
    yield server
    server.destroy()


def samples(url: str) -> Samples:
    text_ = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text_):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def value(metrics: Samples, name: str, **labels: str) -> float | None:
    return metrics.get((name, tuple(sorted(labels.items()))))


def test_no_verdict_is_lost_while_postgresql_is_down(
    tmp_path: Path, own_postgres: OwnPostgres, start_worker: Callable[..., WorkerProcess]
) -> None:
    with Deployment(tmp_path, own_postgres.url, start_worker) as dep:
        watch_the_outage(dep, own_postgres)


def watch_the_outage(dep: Deployment, own_postgres: OwnPostgres) -> None:
    assert dep.kvcanary("db", "upgrade", "--config", str(dep.config)).returncode == 0
    dep.serve()
    defective = dep.name("defective")

    def open_critical() -> dict[str, str] | None:
        for (name, labels), v in samples(dep.url).items():
            found = dict(labels)
            if name == "kvcanary_incidents_open" and v == 1 and found["target"] == defective:
                return found if found["severity"] == "critical" else None
        return None

    labels = dep.wait_for("a critical incident on the defective target", open_critical)

    own_postgres.stop()
    outage_started = time.monotonic()
    dep.wait_for(
        "results to wait in the spool",
        lambda: (value(samples(dep.url), "kvcanary_spool_results") or 0) >= 10,
        timeout=30,
    )
    during = samples(dep.url)
    assert httpx.get(dep.url + "/healthz", timeout=10).status_code == 503
    # The open incident stays visible (last known), and the scrape says the database is away.
    assert value(during, "kvcanary_incidents_open", **labels) == 1
    assert value(during, "kvcanary_database_up") == 0
    # The REST API answers 503 with Retry-After, not a 500 and a traceback per request.
    bearer = {"Authorization": f"Bearer {dep.token}"}
    for path in ["/api/v1/incidents", "/api/v1/probe-results", "/api/v1/incidents/1"] * 20:
        answer = httpx.get(dep.url + path, headers=bearer, timeout=10)
        assert answer.status_code == 503, (path, answer.status_code, answer.text[:300])
        assert answer.headers["retry-after"] and "database" in answer.json()["detail"]
    time.sleep(max(0.0, 8 - (time.monotonic() - outage_started)))

    own_postgres.start()
    dep.wait_for(
        "the spool to drain into the database",
        lambda: (
            value(samples(dep.url), "kvcanary_spool_results") == 0
            and value(samples(dep.url), "kvcanary_database_up") == 1
        ),
        timeout=60,
    )
    assert httpx.get(dep.url + "/api/v1/incidents", headers=bearer, timeout=10).status_code == 200
    assert dep.proc is not None
    stop_process(dep.proc, timeout=30)

    log = dep.log.read_text()
    # One line when the outage began for the API, one when it ended; no traceback.
    assert log.count("the database does not answer API requests") == 1, log[-3000:]
    assert log.count("the database answers API requests again") == 1
    assert "Traceback" not in log
    logged = Counter(m.group(3) for m in VERDICT_LINE.finditer(log))
    assert "spooled in" in log and "replayed" in log, log[-3000:]
    assert logged["leak"] > 0
    engine = create_engine(own_postgres.url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT verdict, count(*) FROM probe_result GROUP BY verdict"))
        stored = Counter({verdict: int(n) for verdict, n in rows})
    engine.dispose()
    assert stored == logged, (stored, logged)
    assert all(v == 0 for (name, _), v in during.items() if name == "kvcanary_results_dropped_total")
