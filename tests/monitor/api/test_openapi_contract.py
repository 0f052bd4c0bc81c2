"""The OpenAPI document is the whole contract: a property-based fuzzer (schemathesis) generates
requests for every operation of the monitor's own ``/openapi.json`` (less ``EXCLUDED``, each with
why), valid ones and invalid ones, sends them to the real app over a real database (SQLite and
PostgreSQL) holding real rows, and checks every answer: no 5xx, no status the operation does not
document, bodies, headers and content types as documented, every schema-invalid request refused,
every operation refused without its token, a 405 naming every method its path serves.

Bounded for CI: ``KVCANARY_FUZZ_EXAMPLES`` (50) examples an operation in the fuzzing phase, beside
schemathesis's own coverage cases (about 1,200 requests a database, 8 s here), from a fixed seed
for runs that repeat each other. Wider, locally::

    KVCANARY_FUZZ_EXAMPLES=300 KVCANARY_FUZZ_SEED=$RANDOM \\
        .venv/bin/pytest tests/monitor/api/test_openapi_contract.py -k every_operation_answers

A failure prints the request as a ``curl`` command; rerun it with the same seed to see it again.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from schemathesis import Case
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.api.main import build_http_app
from kvcanary.monitor.api.state import ApiState
from kvcanary.monitor.config.settings import ContainmentSigningConfig
from kvcanary.monitor.containment import Containment
from kvcanary.monitor.containment.signing import signer_of
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.runs.run_now import RunNow
from kvcanary.monitor.storage.db import make_engine, make_session_factory
from kvcanary.monitor.storage.target_rows import upsert_targets
from kvcanary.monitor.targets.calibration import TokenCalibration
from kvcanary.monitor.traffic.ingest import HttpIngest
from kvcanary.monitor.traffic.judge import TrafficJudge
from kvcanary.monitor.traffic.pipeline import TrafficPipeline
from kvcanary.probes.markers import MarkerBook
from kvcanary.probes.target import ServerCapacity
from kvcanary.wire import VERSION
from tests.support.monitor_app import build_app, settings_with_targets
from tests.support.monitor_db import minutes, record
from tests.support.signing import make_keys

Factory = sessionmaker[Session]
TOKEN = "kvc-test-token-0123456789abcdef"
INGEST = "kvc-ingest-token-0123456789abcdef"
#: Operations a gateway's tap calls: sent with the ingest token, which may call these and no other.
INGEST_OPERATIONS = {"POST /api/v1/traffic", "GET /api/v1/quarantine"}

FUZZ_EXAMPLES = int(os.environ.get("KVCANARY_FUZZ_EXAMPLES", "50"))
FUZZ_SEED = int(os.environ.get("KVCANARY_FUZZ_SEED", "20261129"))

#: Paged lists take parameters whose validity no JSON Schema can state: a cursor is checked by its
#: digest (a made-up one is a 422 naming ``cursor``), ``offset`` cannot come with a cursor,
#: ``since`` must not be later than ``until`` and must be a real day (2026-02-30 matches the
#: pattern). Each such 422 is documented and names its parameter: a schema-valid request to them
#: may be refused with it.
PAGED_LISTS = ["GET /api/v1/incidents", "GET /api/v1/probe-results", "GET /api/v1/traffic"]
#: A query value holding a NUL is refused with a 422 (``known_query``); where a parameter's schema
#: does not say so (the traffic list's ``caller``, the lift's ``reason``), a schema-valid request
#: may be refused with it.
NUL_UNSTATED = ["DELETE /api/v1/targets/{name}/quarantine"]
#: A batch's records obey rules across fields that no JSON Schema states (a refused record has no
#: 2xx status; ``docs/tap-protocol.md``): a schema-valid batch may be refused with a 422 naming the
#: record and the rule, and its other records are still judged.
TRAFFIC_POST = "POST /api/v1/traffic"
#: This app has no configuration file, so every reload is refused (400, as documented): a real
#: reload would read a file this test does not have, and is tested in tests/monitor/config.
RELOAD = "POST /-/reload"

CONFIG = schemathesis.Config.from_dict(
    {
        "seed": FUZZ_SEED,
        "generation": {
            "mode": "all",
            "max-examples": FUZZ_EXAMPLES,
            "database": "none",
            # Each request carries its token (below); a missing or wrong one is the ignored_auth check's.
            "with-security-parameters": False,
        },
        "operations": [
            {
                "include-name": PAGED_LISTS,
                "checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", "401", "422"]}},
            },
            {
                "include-name": NUL_UNSTATED,
                "checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", "401", "404", "422"]}},
            },
            {
                "include-name": TRAFFIC_POST,
                "checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", "401", "422"]}},
            },
            {
                "include-name": RELOAD,
                "checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", "400", "401"]}},
            },
        ],
    }
)


class Calibrated:
    """A target client as the traffic judge reads it: its tokenizer's calibration (one byte, one
    token) and its KV pool. The only seam: these are a running engine's answers over the network."""

    def __init__(self) -> None:
        self.calibration = TokenCalibration()
        self.calibration.note(1000, 1000)

    async def capacity(self, max_age: float = 0.0) -> ServerCapacity:
        return ServerCapacity(kv_pool_tokens=4096)

    async def count_tokens(self, text: str) -> int | None:
        return len(text)


def monitor_app(factory: Factory) -> FastAPI:
    """Return the service's app over ``factory`` holding real rows: both targets, an open critical
    incident with its results, a resolved one, the traffic records a tap posted (one near its
    node's pool, one over it, one refused), and the traffic judge and containment the service
    builds. Run-now runs nothing (a run that judges nothing) and ``/-/reload`` has no file."""
    keys = make_keys(Path(tempfile.mkdtemp(prefix="kvcanary-keys-")))
    settings = settings_with_targets().model_copy(
        update={"containment_signing": ContainmentSigningConfig.model_validate(keys.monitor_config())}
    )
    with factory.begin() as s:
        targets = [(t.name, t.engine, t.base_url, t.model) for t in settings.targets]
        upsert_targets(s, targets, datetime.now(UTC))
    record(factory, "leak", at=minutes(0), detail="alice's marker reached bob")
    record(factory, "pass", at=minutes(1))
    record(factory, "mismatch", at=minutes(10), probe="boundary")
    for i in (11, 12, 13):
        record(factory, "pass", at=minutes(i), probe="boundary")
    record(factory, "error", at=minutes(14), probe="canary", node="prefill-0")
    metrics = MonitorMetrics(CollectorRegistry())
    judge = TrafficJudge(settings, {"glm-prod": Calibrated()}, MarkerBook(), metrics)

    async def run_nothing(name: str) -> list[dict[str, Any]]:
        return []

    containment = Containment(factory, lambda: settings, {}, judge.facts, signer=signer_of(settings))
    asyncio.run(containment.guards.refresh())  # as the service's start does: no guarded target here
    state = ApiState(
        session_factory=factory,
        api_token=TOKEN,
        settings=settings,
        run_now=RunNow(run_nothing, min_interval=0),
        health=lambda: {"scheduler": "running"},
        metrics_page=metrics.exposition,
        ingest_token=INGEST,
        traffic=HttpIngest(TrafficPipeline(judge, None, factory)),
        judge=judge,
        containment=containment,
    )
    app = build_http_app(state)
    with TestClient(app) as tap:
        posted = tap.post("/api/v1/traffic", json=TRAFFIC, headers={"Authorization": f"Bearer {INGEST}"})
        assert posted.json()["accepted"] == len(TRAFFIC["records"]), posted.text
    return app


def _exchange(i: int, **fields: Any) -> dict[str, Any]:
    """A tap's record of one exchange with glm-prod (its pool: 4,096 tokens)."""
    return {
        "id": f"req-{i}", "time": minutes(i).timestamp(), "caller": f"team-{i}", "caller_kind": "team",
        "api_base": "http://127.0.0.1:30000/v1", "status": 200,
        "prompt": {"chars": 2000, "bytes": 2000, "messages": 1}, "usage": {"prompt_tokens": 2010},
    } | fields  # fmt: skip


TRAFFIC = {
    "version": VERSION,
    "gateway": "gw-1",
    "records": [
        _exchange(1, prompt={"chars": 3900, "bytes": 3900}, usage={"prompt_tokens": 3905}),
        _exchange(2, prompt={"chars": 9000, "bytes": 9000}, usage={"prompt_tokens": 1}),
        _exchange(
            3, status=400, usage={}, refused={"by": "admission", "tokens": 9016, "kv_pool_tokens": 4096}
        ),
    ],
}


#: Operations left out of the fuzzing, each with what the fuzzer finds in it. Their routers
#: (monitor/api/traffic.py, monitor/api/containment.py) are the place to mend each; an operation
#: comes off this list when it answers as its document says.
EXCLUDED: dict[str, str] = {}


@pytest.fixture
def api_schema(session_factory: Factory) -> Any:
    loaded = schemathesis.openapi.from_asgi("/openapi.json", monitor_app(session_factory), config=CONFIG)
    loaded.hook(filter_headers)
    return loaded


def filter_headers(context: schemathesis.HookContext, headers: dict[str, Any] | None) -> bool:
    """Send no header but ``Authorization``, the only one an operation here reads.

    Schemathesis counts a header the document does not name as making a request invalid, and
    expects it refused; an HTTP server ignores headers it does not know (proxies add their own), as
    this one does. Undeclared query parameters are still sent, and refused (``known_query``)."""
    return {name.lower() for name in headers or {}} <= {"authorization"}


schema = schemathesis.pytest.from_fixture("api_schema").exclude(name=list(EXCLUDED))


@schema.parametrize()
def test_every_operation_answers_as_its_openapi_document_says(case: Case) -> None:
    token = INGEST if f"{case.method} {case.path}" in INGEST_OPERATIONS else TOKEN
    case.call_and_validate(headers={"Authorization": f"Bearer {token}"})


@pytest.fixture
def document(session_factory: Factory) -> dict[str, Any]:
    loaded = schemathesis.openapi.from_asgi("/openapi.json", monitor_app(session_factory))
    loaded.validate()  # against the OpenAPI 3.1 meta-schema; raises naming the first error
    raw: dict[str, Any] = loaded.raw_schema
    return raw


def test_the_openapi_document_is_valid_openapi_whose_every_reference_resolves(
    document: dict[str, Any],
) -> None:
    operations = {
        f"{method.upper()} {path}": op
        for path, ops in document["paths"].items()
        for method, op in ops.items()
    }
    checked = {"paths": {}, "components": document["components"]}
    for name, operation in operations.items():
        if name not in EXCLUDED:
            method, path = name.split(" ", 1)
            checked["paths"].setdefault(path, {})[method.lower()] = operation

    unresolved = [ref for ref in _references(checked) if _resolve(document, ref) is None]

    assert document["openapi"].startswith("3.1")
    assert set(EXCLUDED) <= set(operations), "an excluded operation is not in the document"
    assert unresolved == []


def test_every_operation_documents_the_statuses_every_operation_can_answer(document: dict[str, Any]) -> None:
    missing = []
    for path, ops in document["paths"].items():
        for method, op in ops.items():
            answers = op["responses"]
            if op.get("security") and "WWW-Authenticate" not in answers.get("401", {}).get("headers", {}):
                missing.append(f"{method.upper()} {path}: 401 with WWW-Authenticate")
            if "requestBody" in op and "400" not in answers:
                missing.append(f"{method.upper()} {path}: 400 for a body that is not text")

    assert missing == []
    assert "Retry-After" in document["paths"]["/api/v1/incidents"]["get"]["responses"]["503"]["headers"]
    page = document["paths"]["/incidents/{incident_id}"]["get"]["responses"]
    assert set(page["503"]["content"]) == set(page["403"]["content"]) == {"application/json"}


def _references(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [ref for value in node.values() for ref in _references(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in _references(value)]
    return []


def _resolve(document: dict[str, Any], ref: str) -> Any:
    """Return what a local ``$ref`` points at in ``document``; None when it points at nothing."""
    if not ref.startswith("#/"):
        return None
    node: Any = document
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


# --- what the fuzzer relies on, request by request -------------------------------------------------


@pytest.fixture
def client(session_factory: Factory) -> Iterator[TestClient]:
    with TestClient(monitor_app(session_factory)) as c:
        c.headers.update({"Authorization": f"Bearer {TOKEN}"})
        yield c


def test_the_seeded_rows_are_served(client: TestClient) -> None:
    incidents = client.get("/api/v1/incidents").json()["items"]
    traffic = client.get("/api/v1/traffic").json()["items"]

    assert sorted((i["probe"], i["state"]) for i in incidents) == [
        ("boundary", "resolved"),
        ("cross_tenant", "open"),
    ]
    assert sorted(r["request_id"] for r in traffic) == ["req-1", "req-2", "req-3"]


@pytest.mark.parametrize(
    ("path", "params", "name"),
    [
        ("/api/v1/incidents", {"severty": "critical"}, "severty"),  # a misspelt filter
        ("/api/v1/incidents", [("target", "glm-prod"), ("target", "llama-dev")], "target"),
        ("/api/v1/probe-results", {"since": "1700000000"}, "since"),  # Unix seconds
        ("/api/v1/probe-results", {"until": "2026-02-30"}, "until"),  # no such day
        ("/api/v1/traffic", {"caller": "team-1\x00"}, "caller"),  # a 500 on PostgreSQL once
        ("/api/v1/incidents/1/blast-radius", {"exclude": "team-1\x00"}, "exclude"),
        ("/api/v1/targets/glm-prod/quarantine", {"reason": "a\x00b"}, "reason"),
    ],
)
def test_a_query_parameter_not_taken_given_twice_or_unreadable_is_422_naming_it(
    client: TestClient, path: str, params: Any, name: str
) -> None:
    response = client.request("DELETE" if path.endswith("quarantine") else "GET", path, params=params)

    assert response.status_code == 422, response.text
    assert ["query", name] in [error["loc"] for error in response.json()["detail"]]


@pytest.mark.parametrize(
    ("since", "opened"),
    [
        ("2026-11-29", 2),
        ("2026-11-29T12:05", 1),
        ("2026-11-29 12:05:00Z", 1),
        ("2026-11-29T13:05:00+01:00", 1),
        ("2026-11-29T12:05:00.5+0000", 1),
        ("2026-11-29T12:11:00Z", 0),
    ],
)
def test_a_date_or_a_time_with_or_without_an_offset_bounds_a_list(
    client: TestClient, since: str, opened: int
) -> None:
    response = client.get("/api/v1/incidents", params={"since": since})

    assert response.status_code == 200, response.text
    assert len(response.json()["items"]) == opened


def test_a_405_names_every_method_its_path_serves(client: TestClient) -> None:
    quarantine = client.put("/api/v1/targets/glm-prod/quarantine")
    traffic = client.delete("/api/v1/traffic")

    assert (quarantine.status_code, quarantine.headers["Allow"]) == (405, "POST, DELETE")
    assert (traffic.status_code, traffic.headers["Allow"]) == (405, "GET, POST")


def test_a_body_that_is_not_text_is_the_documented_400(client: TestClient) -> None:
    path = "/api/v1/targets/{name}/quarantine"
    documented = client.get("/openapi.json").json()["paths"][path]["post"]["responses"]

    response = client.post(
        path.format(name="glm-prod"),
        content=b'{"reason": "\xff"}',
        headers={"Content-Type": "application/json"},
    )

    assert response.status_code == 400 and "400" in documented
    assert set(response.json()) == {"detail"}


def test_every_read_answers_the_documented_503_while_the_database_is_away(tmp_path: Any) -> None:
    away = make_session_factory(make_engine(f"sqlite:///{tmp_path / 'no' / 'such' / 'dir.db'}"))
    app = build_app(away, settings=settings_with_targets(), token=TOKEN)
    reads = {
        "/api/v1/incidents": "/api/v1/incidents",
        "/api/v1/incidents/{incident_id}": "/api/v1/incidents/1",
        "/api/v1/incidents/{incident_id}/blast-radius": "/api/v1/incidents/1/blast-radius",
        "/api/v1/probe-results": "/api/v1/probe-results",
        "/api/v1/targets": "/api/v1/targets",
        "/incidents/{incident_id}": "/incidents/1",
    }
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        paths = c.get("/openapi.json").json()["paths"]
        for template, path in reads.items():
            response = c.get(path)
            documented = paths[template]["get"]["responses"]["503"]

            assert response.status_code == 503, (path, response.text)
            assert set(response.json()) == {"detail"} and response.headers["Retry-After"] == "5"
            assert "application/json" in documented["content"] and "Retry-After" in documented["headers"]
