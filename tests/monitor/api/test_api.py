"""The REST API over a real database. The only seam is the runner behind ``run-now (ApiState.run_now)``."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.storage.db import make_engine, make_session_factory
from tests.support.monitor_app import build_app, settings_with_targets
from tests.support.monitor_db import minutes, record

Factory = sessionmaker[Session]
TOKEN = "kvc-test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def client(session_factory: Factory) -> Iterator[TestClient]:
    app = build_app(session_factory, settings=settings_with_targets(), token=TOKEN)
    with TestClient(app) as c:
        c.headers.update(AUTH)
        yield c


@pytest.fixture
def seeded(session_factory: Factory) -> dict[str, Any]:
    """An open critical incident on glm-prod (leak, then a pass) and a resolved high one."""
    leak = record(session_factory, "leak", at=minutes(0), detail="alice's marker reached bob")
    record(session_factory, "pass", at=minutes(1))
    high = record(session_factory, "mismatch", at=minutes(10), probe="boundary")
    for i in (11, 12, 13):
        record(session_factory, "pass", at=minutes(i), probe="boundary")
    return {"critical": leak.incident_id, "high": high.incident_id, "leak_result": leak.result_id}


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/api/v1/incidents"),
        ("GET", "/api/v1/incidents/1"),
        ("GET", "/api/v1/probe-results"),
        ("GET", "/api/v1/targets"),
        ("POST", "/api/v1/targets/glm-prod/run"),
    ],
)
@pytest.mark.parametrize("header", [None, "Bearer wrong-token", f"Basic {TOKEN}", "Bearer "])
def test_every_api_route_requires_the_bearer_token(
    client: TestClient, method: str, path: str, header: str | None
) -> None:
    headers = {"Authorization": header} if header else {}
    client.headers.pop("Authorization")

    response = client.request(method, path, headers=headers)

    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert TOKEN not in response.text


def test_a_local_only_api_needs_no_token(session_factory: Factory) -> None:
    app = build_app(session_factory, settings=settings_with_targets(), token=None)
    with TestClient(app) as c:
        assert c.get("/api/v1/incidents").status_code == 200


def test_healthz_needs_no_token_and_reports_the_scheduler(session_factory: Factory) -> None:
    app = build_app(
        session_factory,
        settings=settings_with_targets(),
        token=TOKEN,
        health=lambda: {"scheduler": "running", "targets": 2},
    )
    with TestClient(app) as c:
        response = c.get("/healthz")

    assert response.status_code == 200
    assert response.json() == {"status": "ok", "database": "ok", "scheduler": "running", "targets": 2}


def test_healthz_is_503_when_the_database_is_unreachable(tmp_path: Any) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'no' / 'such' / 'dir.db'}")
    app = build_app(make_session_factory(engine), settings=settings_with_targets(), token=TOKEN)
    with TestClient(app) as c:
        response = c.get("/healthz")

    assert response.status_code == 503
    assert response.json()["database"] == "unreachable" and response.json()["status"] == "unhealthy"


def test_incidents_are_listed_with_filters_and_pagination(client: TestClient, seeded: dict[str, Any]) -> None:
    everything = client.get("/api/v1/incidents").json()
    open_only = client.get("/api/v1/incidents", params={"state": "open"}).json()
    second_page = client.get("/api/v1/incidents", params={"limit": 1, "offset": 1}).json()
    window = client.get(
        "/api/v1/incidents", params={"since": "2026-11-29T12:05:00Z", "until": "2026-11-29T12:30:00Z"}
    ).json()
    by_probe = client.get("/api/v1/incidents", params={"target": "glm-prod", "probe": "boundary"}).json()

    assert [i["id"] for i in everything["items"]] == [seeded["high"], seeded["critical"]]
    assert (everything["next_cursor"], everything["limit"]) == (None, 50) and "total" not in everything
    assert [(i["severity"], i["state"], i["target"]) for i in open_only["items"]] == [
        ("critical", "open", "glm-prod")
    ]
    assert ([i["id"] for i in second_page["items"]], second_page["next_cursor"]) == (
        [seeded["critical"]],
        None,
    )
    assert [i["id"] for i in window["items"]] == [seeded["high"]]
    assert [i["id"] for i in by_probe["items"]] == [seeded["high"]]
    assert everything["items"][1]["opened_at"] == "2026-11-29T12:00:01Z"


def test_an_incident_shows_its_timeline_and_evidence(client: TestClient, seeded: dict[str, Any]) -> None:
    body = client.get(f"/api/v1/incidents/{seeded['critical']}").json()

    assert body["title"] == "leak on glm-prod/cross_tenant: alice's marker reached bob"
    assert [(e["kind"], e["new_severity"], e["processed_at"]) for e in body["events"]] == [
        ("opened", "critical", None)
    ]
    assert [r["verdict"] for r in body["results"]] == ["pass", "leak"]
    leak = body["results"][1]
    assert (leak["id"], leak["evidence"], leak["incident_id"]) == (
        seeded["leak_result"],
        {"marker_ids": ["m-1"]},
        seeded["critical"],
    )


def test_a_resolved_incident_shows_when_and_why(client: TestClient, seeded: dict[str, Any]) -> None:
    body = client.get(f"/api/v1/incidents/{seeded['high']}", params={"results": 1}).json()

    assert body["state"] == "resolved" and body["resolved_at"] is not None
    assert [e["kind"] for e in body["events"]] == ["opened", "resolved"]
    assert len(body["results"]) == 1


def test_an_absent_incident_is_404(client: TestClient) -> None:
    response = client.get("/api/v1/incidents/999999")

    assert response.status_code == 404
    assert response.json() == {"detail": "incident 999999 not found"}


def test_probe_results_are_listed_with_filters_a_page_at_a_time(
    client: TestClient, seeded: dict[str, Any]
) -> None:
    passes = client.get("/api/v1/probe-results", params={"verdict": "pass", "limit": 2}).json()
    more = client.get(
        "/api/v1/probe-results", params={"verdict": "pass", "limit": 3, "cursor": passes["next_cursor"]}
    ).json()
    leaks = client.get("/api/v1/probe-results", params={"verdict": "leak", "target": "glm-prod"}).json()

    assert (len(passes["items"]), passes["limit"]) == (2, 2) and passes["next_cursor"]
    assert [r["started_at"] for r in passes["items"]] == ["2026-11-29T12:13:00Z", "2026-11-29T12:12:00Z"]
    assert [r["started_at"] for r in more["items"]] == ["2026-11-29T12:11:00Z", "2026-11-29T12:01:00Z"]
    assert more["next_cursor"] is None, "the last page says so: no count needed"
    assert [r["id"] for r in leaks["items"]] == [seeded["leak_result"]]


@pytest.mark.parametrize(
    "path, params, names",
    [
        ("/api/v1/incidents", {"severity": "catastrophic"}, "severity"),
        ("/api/v1/incidents", {"state": "closed"}, "state"),
        ("/api/v1/incidents", {"since": "yesterday"}, "since"),
        ("/api/v1/incidents", {"limit": 0}, "limit"),
        ("/api/v1/incidents", {"limit": 501}, "limit"),
        ("/api/v1/incidents", {"offset": -1}, "offset"),
        ("/api/v1/incidents", {"since": "2026-11-30T00:00:00Z", "until": "2026-11-29T00:00:00Z"}, "since"),
        ("/api/v1/incidents/abc", {}, "incident_id"),
        ("/api/v1/probe-results", {"verdict": "ok"}, "verdict"),
        ("/api/v1/probe-results", {"until": "2026-13-01"}, "until"),
        ("/api/v1/incidents", {"offset": 2**63}, "offset"),
        ("/api/v1/incidents", {"offset": 10_001}, "offset"),
        ("/api/v1/probe-results", {"offset": 1, "cursor": "AQAAAAAAAAAAAAAAAQAAAAAAAAAA"}, "offset"),
        ("/api/v1/probe-results", {"cursor": "AQAAAAAAAAAAAAAAAQAAAAAAAAAA"}, "cursor"),
        ("/api/v1/incidents", {"cursor": "a b"}, "cursor"),
        ("/api/v1/incidents/9223372036854775808", {}, "incident_id"),
        ("/api/v1/incidents/2147483648", {}, "incident_id"),
        ("/api/v1/incidents", {"since": "0001-01-01T00:00:00+14:00"}, "since"),
        ("/api/v1/probe-results", {"until": "9999-12-31T23:59:59-14:00"}, "until"),
        ("/api/v1/incidents", {"target": "a\x00b"}, "target"),
        ("/api/v1/probe-results", {"probe": "x" * 100}, "probe"),
    ],
)
def test_bad_parameters_are_422_naming_the_parameter(
    client: TestClient, path: str, params: dict[str, Any], names: str
) -> None:
    response = client.get(path, params=params)

    assert response.status_code == 422
    assert names in [err["loc"][-1] for err in response.json()["detail"]], response.json()


def test_targets_show_configuration_and_last_verdicts(client: TestClient, seeded: dict[str, Any]) -> None:
    response = client.get("/api/v1/targets")

    assert response.status_code == 200
    prod, dev = response.json()["items"]
    assert (prod["name"], prod["engine"], prod["base_url"]) == (
        "glm-prod",
        "sglang",
        "http://127.0.0.1:30000",
    )
    assert prod["probes"] == ["canary", "cross_tenant"]
    assert "canary" not in prod["last_verdicts"], "not judged yet"
    assert prod["last_verdicts"]["cross_tenant"] == {
        "verdict": "pass",
        "started_at": "2026-11-29T12:01:00Z",
        "reason": "ok",
        "node": "",
    }
    # The leak's incident is still open after the pass (it resolves after several): listed.
    [incident] = prod["open_incidents"]
    assert (incident["id"], incident["probe"], incident["node"]) == (seeded["critical"], "cross_tenant", "")
    assert (dev["name"], dev["last_verdicts"], dev["open_incidents"]) == ("llama-dev", {}, [])


def test_a_pass_down_one_path_does_not_hide_the_open_leak_of_another(
    client: TestClient, session_factory: Factory
) -> None:
    """A gateway target's probes run down each prefill x decode path: the latest verdict may come
    from a sound pair while another leaks. The targets API says which path each came from, and lists
    the open incident with the pair that leaked."""
    leak = record(session_factory, "leak", at=minutes(0), probe="canary", node="small--d0")
    record(session_factory, "pass", at=minutes(1), probe="canary", node="roomy--d0")

    [prod, _] = client.get("/api/v1/targets").json()["items"]

    last = prod["last_verdicts"]["canary"]
    assert (last["verdict"], last["node"]) == ("pass", "roomy--d0")
    assert [(i["id"], i["probe"], i["node"], i["severity"]) for i in prod["open_incidents"]] == [
        (leak.incident_id, "canary", "small--d0", "critical")
    ]


def test_running_a_target_calls_the_runner_and_returns_its_summaries(session_factory: Factory) -> None:
    calls: list[str] = []

    async def run_target(name: str) -> list[dict[str, Any]]:
        calls.append(name)
        return [
            {
                "probe": "canary",
                "verdict": "pass",
                "reason": "ok",
                "detail": "",
                "result_id": 7,
                "incident_id": None,
            },
            {
                "probe": "cross_tenant",
                "verdict": "leak",
                "reason": "foreign_marker",
                "detail": "alice -> bob",
                "result_id": 8,
                "incident_id": 3,
            },
        ]

    app = build_app(session_factory, settings=settings_with_targets(), token=TOKEN, run_target=run_target)
    with TestClient(app, headers=AUTH) as c:
        response = c.post("/api/v1/targets/glm-prod/run")
        unknown = c.post("/api/v1/targets/nope/run")

    assert response.status_code == 200 and calls == ["glm-prod"]
    assert response.json()["target"] == "glm-prod"
    assert [(r["probe"], r["verdict"], r["incident_id"]) for r in response.json()["results"]] == [
        ("canary", "pass", None),
        ("cross_tenant", "leak", 3),
    ]
    assert unknown.status_code == 404 and calls == ["glm-prod"]


def test_a_run_whose_runner_fails_says_so(client: TestClient) -> None:
    # The default runner in build_app raises KeyError for every name.
    response = client.post("/api/v1/targets/glm-prod/run")

    assert response.status_code == 200
    assert (response.json()["status"], response.json()["results"]) == ("failed", [])
    assert "glm-prod" in response.json()["error"]
    again = client.get(f"/api/v1/targets/glm-prod/runs/{response.json()['run_id']}")
    assert again.status_code == 200 and again.json()["status"] == "failed"


def test_the_openapi_document_declares_models_auth_and_errors(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()

    incidents = doc["paths"]["/api/v1/incidents"]["get"]
    detail = doc["paths"]["/api/v1/incidents/{incident_id}"]["get"]
    run = doc["paths"]["/api/v1/targets/{name}/run"]["post"]
    assert {"200", "401", "422"} <= set(incidents["responses"])
    assert {"200", "401", "404"} <= set(detail["responses"]) and "404" in run["responses"]
    assert incidents["security"] == [{"HTTPBearer": []}]
    assert "security" not in doc["paths"]["/healthz"]["get"]
    assert {"IncidentPage", "IncidentDetailOut", "ProbeResultPage", "TargetList", "RunOut"} <= set(
        doc["components"]["schemas"]
    )
    assert {p["name"] for p in incidents["parameters"]} >= {"cursor", "limit", "offset"}
    assert "next_cursor" in doc["components"]["schemas"]["IncidentPage"]["required"]


def test_the_docs_page_loads_its_assets_from_the_monitor_not_a_cdn(tmp_path: pathlib.Path) -> None:
    from kvcanary.monitor.app import Monitor
    from kvcanary.monitor.config.settings import parse_settings
    from kvcanary.monitor.http_app import create_app
    from kvcanary.monitor.storage.db import upgrade

    url = f"sqlite:///{tmp_path / 'k.db'}"
    upgrade(url)
    config = {"database_url": url, "api": {"local_only": True}, "spool": {"in_memory": True}}
    settings = parse_settings(config)
    with TestClient(create_app(Monitor.open(settings), start_scheduler=False)) as c:
        page = c.get("/docs").text
        assert "cdn" not in page.lower() and "/docs/static/swagger-ui-bundle.js" in page
        assert c.get("/docs/static/swagger-ui-bundle.js").status_code == 200
        assert c.get("/docs/static/swagger-ui.css").status_code == 200
