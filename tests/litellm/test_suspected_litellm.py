"""Containment acts on proof, not on a hint, end to end: ``kvcanary serve`` under
``containment.mode: quarantine`` and a real LiteLLM proxy with the tap, quarantine on, in front of
two model groups.

- ``shop`` is a healthy engine that knows the Gettysburg Address. One customer pastes it to be
  summarised; another asks the engine to recite it, and it does. The fingerprint check calls that a
  leak, as it must (it cannot tell a recital from a stale page): a ``suspected`` incident opens and
  pages, the target's proving probes run at once and find nothing, and the deployment is never
  quarantined: the gateway keeps sending customers to it.
- ``lab`` is a reference worker with the incident's defect (a prefill pool under the window, the
  placeholder admission). One customer's private document is in its pages when another customer's
  over-pool prompt is answered from them: the same check flags it, and the verification it starts
  proves it (``boundary``: a 2xx for a prompt the pool cannot hold, another tenant's marker in it);
  the target is quarantined within 2 s of the proof, and the gateway refuses ``lab`` from then on.

Scheduled runs are a day apart, so every probe run seen here is a verification's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from kvcanary.monitor.storage.db import make_engine, make_session_factory
from kvcanary.monitor.storage.models import Incident, IncidentEvent, Target
from tests.litellm.test_containment_litellm import DEFECTIVE, INGEST
from tests.monitor.served import Served, reference_target
from tests.support import WorkerProcess, launch_worker, stop_process, wait_worker
from tests.support.benign_engine import BenignEngine, BenignServer
from tests.support.litellm import Proxy, start_proxy
from tests.support.signing import SigningKeys, make_keys, served_set

pytestmark = pytest.mark.external_service

GETTYSBURG = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, "
    "conceived in Liberty, and dedicated to the proposition that all men are created equal. Now we "
    "are engaged in a great civil war, testing whether that nation, or any nation so conceived and "
    "so dedicated, can long endure. We are met on a great battle-field of that war. We have come to "
    "dedicate a portion of that field, as a final resting place for those who here gave their lives "
    "that that nation might live. It is altogether fitting and proper that we should do this. But, "
    "in a larger sense, we can not dedicate, we can not consecrate, we can not hallow this ground. "
    "The brave men, living and dead, who struggled here, have consecrated it, far above our poor "
    "power to add or detract."
)
PRIVATE = (
    "Globex board memo, not for distribution: the Springfield plant closes on 14 March; severance "
    "offers go to the 212 staff of line three first, the Shelbyville supplier contract is not "
    "renewed, and the acquisition of Initech's battery unit is priced at 41 million before the due "
    "diligence ends. Legal keeps the settlement with the county confidential until the audit closes. "
)
DAY = 86400.0
# A request's time bound leaves a loaded machine's CPU workers room: a verification's run that timed
# out is no proof, and with runs a day apart nothing would run again within the wait.
PROBES = {"probes": ["canary", "cross_tenant", "boundary"], "interval_seconds": DAY, "timeout_seconds": 45}
ACME, GLOBEX, INITECH = "sk-acme-0001", "sk-globex-0002", "sk-initech-0003"


class RecitingEngine(BenignEngine):
    """A correct engine with one piece of world knowledge: asked to recite the Gettysburg
    Address, it does, as any instruction-tuned model would."""

    def ideal(self, turns: list[tuple[str, str]]) -> str:
        if turns and "recite the Gettysburg Address" in turns[-1][1]:
            return GETTYSBURG
        if turns and turns[-1][1].startswith("Summarise"):
            return "A short speech on equality, sacrifice and a nation's endurance."
        return super().ideal(turns)

    def answer(self, body: dict[str, Any]) -> str:
        turns = self.conversation(body)
        if turns and "recite the Gettysburg Address" in turns[-1][1]:
            return GETTYSBURG  # no drift in a recital: the customer gets the whole speech
        return super().answer(body)


class RecitingServer(BenignServer):
    def __init__(self) -> None:
        self.engine = RecitingEngine("instruct", seed=1863)
        super(BenignServer, self).__init__(self.engine.app())


@dataclass
class Scene:
    monitor: Served
    proxy: Proxy
    healthy: RecitingServer
    defective: WorkerProcess
    keys: SigningKeys


@pytest.fixture
def scene(served: Any, tmp_path: Path) -> Iterator[Scene]:
    keys = make_keys(tmp_path / "keys")
    healthy = RecitingServer()
    defective = launch_worker(DEFECTIVE, tmp_path)
    proxy = None
    try:
        wait_worker(defective)
        monitor = served({
            "targets": [reference_target("shop", healthy.url, **PROBES),
                        reference_target("lab", defective.url, **PROBES)],
            "containment": {"mode": "quarantine"},
            "containment_signing": keys.monitor_config(),
            "traffic": {"ingest_token_env": "KVC_TEST_INGEST", "pass_interval_seconds": 5},
        })  # fmt: skip
        monitor.env["KVC_TEST_INGEST"] = INGEST
        monitor.start()
        env = {
            "KVCANARY_TAP_URL": monitor.url, "KVCANARY_TAP_TOKEN": INGEST, "KVCANARY_TAP_GATEWAY": "gw-trust",
            "KVCANARY_TAP_KEY": "a-fingerprint-key-the-monitor-never-sees", "KVCANARY_TAP_QUARANTINE": "1",
            "KVCANARY_TAP_QUARANTINE_POLL_SECONDS": "0.5", "KVCANARY_TAP_FLUSH_SECONDS": "0.2",
            **keys.tap_env(),
        }  # fmt: skip
        proxy = start_proxy(tmp_path / "gateway", {"shop": healthy.url, "lab": defective.url}, env)
        yield Scene(monitor, proxy, healthy, defective, keys)
    finally:
        if proxy is not None:
            stop_process(proxy.proc)
        stop_process(defective.proc)
        healthy.close()


def ask(scene: Scene, key: str, group: str, text: str, max_tokens: int) -> httpx.Response:
    return httpx.post(
        f"{scene.proxy.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": group, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens},
        timeout=60,
    )


def incidents(monitor: Served, target: str) -> list[Incident]:
    engine = make_engine(monitor.config["database_url"])
    try:
        with make_session_factory(engine)() as s:
            query = (
                select(Incident).join(Target, Target.id == Incident.target_id).where(Target.name == target)
            )
            return list(s.scalars(query.order_by(Incident.id)))
    finally:
        engine.dispose()


def timeline(monitor: Served, incident_id: int) -> list[IncidentEvent]:
    engine = make_engine(monitor.config["database_url"])
    try:
        with make_session_factory(engine)() as s:
            query = select(IncidentEvent).where(IncidentEvent.incident_id == incident_id)
            return list(s.scalars(query.order_by(IncidentEvent.id)))
    finally:
        engine.dispose()


def deployments(scene: Scene) -> list[dict[str, Any]]:
    """The deployments of the set the monitor serves the gateways, its signature checked."""
    return list(served_set(scene.monitor.url, INGEST, scene.keys)["deployments"])


def quarantined(scene: Scene) -> set[str]:
    return {entry["target"] for entry in deployments(scene) if entry["enforced"]}


def proven_leak(monitor: Served, target: str) -> Incident | None:
    """The first certain critical incident a probe (not a traffic check) opened on ``target``."""
    leaks = [i for i in incidents(monitor, target) if i.severity == "critical" and i.certainty == "certain"]
    return next((i for i in leaks if not i.probe.startswith("traffic_")), None)


def verification(monitor: Served, incident: Incident) -> IncidentEvent | None:
    done = [e for e in timeline(monitor, incident.id) if e.kind == "verification"]
    return done[0] if done else None


def story(monitor: Served, target: str) -> str:
    """Each incident on ``target`` and its timeline's events, a line each."""
    lines = []
    for incident in incidents(monitor, target):
        i = incident
        lines.append(f"{i.id} {i.probe} {i.severity} {i.certainty} opened {i.opened_at:%H:%M:%S.%f}")
        lines += [f"  {e.kind} {e.reason} {e.note or ''}" for e in timeline(monitor, incident.id)]
    return "\n".join(lines) or "none"


def test_customers_sharing_a_public_text_quarantine_nothing_and_a_real_leak_is_proven_and_contained(
    scene: Scene,
) -> None:
    monitor = scene.monitor
    # --- a public text, quoted by two customers ---------------------------------------------------------
    assert ask(scene, ACME, "shop", f"Summarise this speech:\n{GETTYSBURG}", 64).status_code == 200
    recital = ask(scene, GLOBEX, "shop", "Please recite the Gettysburg Address.", 512)
    assert recital.status_code == 200 and "Four score and seven" in recital.text
    hint = monitor.wait_for(
        "the suspected leak on shop",
        lambda: next((i for i in incidents(monitor, "shop") if i.certainty == "suspected"), None),
        timeout=30,
    )
    assert hint.probe in ("traffic_overlap", "traffic_reworded") and hint.severity == "critical"
    checked = monitor.wait_for("its verification", lambda: verification(monitor, hint), timeout=60)
    assert checked.reason == "none_found", checked.note
    assert {"canary", "cross_tenant", "boundary"} <= {run.split(":")[0] for run in checked.note.split("; ")}
    time.sleep(2)  # two rounds of the rules and four polls of the tap after the verification
    assert quarantined(scene) == set()
    assert {i.certainty for i in incidents(monitor, "shop")} == {"suspected"}  # hints, and no proof
    served = [ask(scene, INITECH, "shop", "Say OK", 4).status_code for _ in range(5)]
    assert served.count(200) >= 4, served  # the benign engine's own rare 503 aside

    # --- a real leak through the same gateway ---------------------------------------------------------
    assert ask(scene, GLOBEX, "lab", PRIVATE * 2, 16).status_code == 200  # in the pages, then freed
    stale = ask(scene, ACME, "lab", "Continue this log: " + "x" * 2000, 600)
    assert stale.status_code == 200  # the defect: a 200 from pages another customer wrote
    try:
        proof = monitor.wait_for("a certain leak on lab", lambda: proven_leak(monitor, "lab"), timeout=90)
    except AssertionError as missed:  # what the monitor made of lab, which a log's tail can have lost
        raise AssertionError(f"{missed}\n--- lab's incidents ---\n{story(monitor, 'lab')}") from None
    found = [(i.probe, i.severity, i.certainty) for i in incidents(monitor, "lab")]
    hints = [i for i in incidents(monitor, "lab") if i.certainty == "suspected"]
    assert hints and hints[0].opened_at <= proof.opened_at, found
    # The over-pool 2xx itself is certain too (the capacity check), but a mismatch: it pages only.
    suspicion_to_proof = (proof.opened_at - hints[0].opened_at).total_seconds()
    assert proof.probe in ("boundary", "cross_tenant", "canary"), proof.probe
    monitor.wait_for("lab quarantined", lambda: "lab" in quarantined(scene), timeout=10)
    refused_at = monitor.wait_for(
        "the gateway refusing lab",
        lambda: time.time() if ask(scene, INITECH, "lab", "Say OK", 4).status_code == 503 else None,
        timeout=10,
    )
    proven_to_refused = refused_at - proof.opened_at.timestamp()
    assert proven_to_refused < 2.0 + 1.0, proven_to_refused  # the 2 s promise, and a request's own time
    assert "shop" not in quarantined(scene)
    print(f"suspicion to proof {suspicion_to_proof:.2f} s; proof to refusal {proven_to_refused:.2f} s")
    with_quarantine = deployments(scene)
    assert [(e["target"], e["cause"]) for e in with_quarantine] == [("lab", "incident")]
    assert datetime.fromisoformat(with_quarantine[0]["since"]) >= proof.opened_at
