"""An operator's word on a suspected incident over the API (``POST /api/v1/incidents/{id}/confirm``
and ``.../dismiss``), on the service's own app over SQLite and PostgreSQL: what each answers and
changes, what containment then does, and how each refusal is said."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.api.main import build_http_app
from kvcanary.monitor.api.state import ApiState
from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.containment import Containment
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.runs.run_now import RunNow
from kvcanary.monitor.traffic.facts import TargetFacts
from tests.support.monitor_db import minutes, record
from tests.support.signing import make_keys

Factory = sessionmaker[Session]
TOKEN = "kvc-test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def app(session_factory: Factory, tmp_path: Path) -> Iterator[tuple[TestClient, Containment, dict[str, int]]]:
    keys = make_keys(tmp_path / "keys")
    tenants = [{"name": "alice"}, {"name": "bob"}]
    settings = Settings.model_validate({
        "targets": [{"name": "glm-prod", "base_url": "http://127.0.0.1:30000", "tenants": tenants}],
        "containment": {"mode": "quarantine"},
        "containment_signing": keys.monitor_config(),
    })  # fmt: skip
    ids = {
        "suspected": record(
            session_factory, "leak", at=minutes(0), probe="traffic_overlap", certainty="suspected"
        ),
        "hint": record(
            session_factory, "leak", at=minutes(1), probe="traffic_reworded", certainty="suspected"
        ),
        "certain": record(session_factory, "mismatch", at=minutes(2), probe="boundary"),
    }
    containment = Containment(session_factory, lambda: settings, {}, TargetFacts(lambda: settings, {}))

    async def no_run(name: str) -> list[dict[str, Any]]:
        raise KeyError(name)

    state = ApiState(
        session_factory=session_factory, api_token=TOKEN, settings=settings,
        run_now=RunNow(no_run, min_interval=0), health=lambda: {},
        metrics_page=MonitorMetrics(CollectorRegistry()).exposition, containment=containment,
    )  # fmt: skip
    with TestClient(build_http_app(state)) as client:
        yield client, containment, {name: done.incident_id or 0 for name, done in ids.items()}


def test_incidents_say_how_each_is_known(app: tuple[TestClient, Containment, dict[str, int]]) -> None:
    client, _, ids = app
    listed = {i["id"]: i["certainty"] for i in client.get("/api/v1/incidents", headers=AUTH).json()["items"]}
    assert listed == {ids["suspected"]: "suspected", ids["hint"]: "suspected", ids["certain"]: "certain"}
    detail = client.get(f"/api/v1/incidents/{ids['suspected']}", headers=AUTH).json()
    assert [r["certainty"] for r in detail["results"]] == ["suspected"]
    targets = client.get("/api/v1/targets", headers=AUTH).json()["items"]
    assert sorted(i["certainty"] for i in targets[0]["open_incidents"]) == [
        "certain",
        "suspected",
        "suspected",
    ]


def test_a_confirmation_is_in_the_timeline_and_quarantines_the_target(
    app: tuple[TestClient, Containment, dict[str, int]],
) -> None:
    client, containment, ids = app
    assert containment.rules.sync() == []  # hints alone move nothing
    said = client.post(f"/api/v1/incidents/{ids['suspected']}/confirm", headers=AUTH,
                       json={"note": "a private contract draft"})  # fmt: skip
    assert said.status_code == 200, said.text
    assert (said.json()["id"], said.json()["certainty"], said.json()["state"]) == (
        ids["suspected"],
        "confirmed",
        "open",
    )
    events = client.get(f"/api/v1/incidents/{ids['suspected']}", headers=AUTH).json()["events"]
    assert (events[-1]["kind"], events[-1]["note"]) == ("confirmed", "a private contract draft")
    containment.rules.sync()
    assert [(q.target, q.incident_id) for q in containment.rules.current()] == [
        ("glm-prod", ids["suspected"])
    ]


def test_a_dismissal_resolves_the_incident(app: tuple[TestClient, Containment, dict[str, int]]) -> None:
    client, _, ids = app
    said = client.post(
        f"/api/v1/incidents/{ids['hint']}/dismiss", headers=AUTH, json={"note": "a public speech"}
    )
    assert said.status_code == 200 and said.json()["state"] == "resolved"


@pytest.mark.parametrize(
    ("which", "body", "status"),
    [
        ("certain", {"note": "no"}, 409),  # proof needs no word, and a dismissal cannot undo it
        ("missing", {"note": "no"}, 404),
        ("suspected", {}, 422),
        ("suspected", {"note": ""}, 422),
        ("suspected", {"note": "a\x00b"}, 422),
    ],
)
def test_a_word_that_does_not_apply_is_refused_naming_why(
    app: tuple[TestClient, Containment, dict[str, int]], which: str, body: dict[str, str], status: int
) -> None:
    client, _, ids = app
    incident = ids.get(which, 10_000)
    for act in ("confirm", "dismiss"):
        said = client.post(f"/api/v1/incidents/{incident}/{act}", headers=AUTH, json=body)
        assert said.status_code == status, said.text
    assert client.post(f"/api/v1/incidents/{ids['suspected']}/confirm", json={"note": "x"}).status_code == 401
    states = {
        i["id"]: (i["state"], i["certainty"])
        for i in client.get("/api/v1/incidents", headers=AUTH).json()["items"]
    }
    assert states[ids["suspected"]] == ("open", "suspected") and states[ids["certain"]] == ("open", "certain")
