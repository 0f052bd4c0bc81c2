"""Verdicts as OpenTelemetry GenAI evaluation events (monitor/otel.py), received by a real OTLP/HTTP
receiver started here (tests/support/otlp.py) that decodes what the official SDK's exporter sends.

- Each verdict is one ``gen_ai.evaluation.result`` event with the conventions' attributes and
  kvcanary's own, and nothing a customer wrote, no caller, no key.
- ``offer`` never waits: a full queue drops and counts; a collector that refuses or hangs is counted.
- ``otel:`` is checked at start (a bad value names its key) and its headers come from env or a file.
- End to end: a real ``kvcanary serve`` probing a reference worker sends a probe's verdict, and a
  traffic check's on a record the real tap made from a customer's exchange.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvcanary.monitor.config.settings import ConfigError, OtelConfig, parse_settings
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.otel import EVENT_NAME, VerdictEvents, otlp_headers
from kvcanary.monitor.recording.pending import PendingResult, Source
from kvcanary.monitor.storage.incident_rows import RecordOutcome
from kvcanary.probes.base import ProbeResult, Verdict
from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.record import Exchange, summarize
from kvcanary.wire import VERSION
from tests.monitor.served import Served, reference_target, served  # noqa: F401  (the fixture)
from tests.probes.probe_harness import KEYS
from tests.support import REPO
from tests.support.otlp import OtlpReceiver, otlp_receiver
from tests.support.workers import WorkerProcess

CUSTOMER_PROMPT = "Summarise the merger memo for Harriet Quayle, account 4417-2210-9981: " * 60
CUSTOMER_ANSWER = "Harriet Quayle's merger closes on the ninth; the memo advises silence."


def dropped(metrics: MonitorMetrics, reason: str) -> float:
    return metrics.otel_dropped.labels(reason)._value.get()


def traffic_verdict(
    *, kind: str = "traffic_tokens", source: Source = Source.TRAFFIC, **said: Any
) -> PendingResult:
    """A traffic check's mismatch as the judge files it: its evidence names a customer's record."""
    record = {"request_id": "rec-1", "upstream_id": "chatcmpl-7Qx", "caller": "team-blue", "reason": "x"}
    result: dict[str, Any] = {
        "verdict": Verdict.MISMATCH, "reason": "prompt_tokens_low",
        "detail": f"1 record of 1 caller failed: first: request chatcmpl-7Qx of team-blue: {CUSTOMER_ANSWER}",
        "evidence": {"gateway": "gw-1", "records": [record], "excerpt": CUSTOMER_ANSWER},
        "measurements": {"records": 1.0},
    }  # fmt: skip
    at = datetime(2026, 12, 6, 10, 0, tzinfo=UTC)
    return PendingResult(
        target="glm-prod", engine="sglang", base_url="http://10.0.0.5:30000", model="glm-5.3", kind=kind,
        result=ProbeResult(**{**result, **said}), started_at=at, duration_seconds=0.0, attempted_at=at,
        node="prefill-0", source=source,
    )  # fmt: skip


def events_until(receiver: OtlpReceiver, count: int, timeout: float = 15) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(found := receiver.events()) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{len(receiver.events())} of {count} events arrived")


# --- the event --------------------------------------------------------------------------------------


def test_a_verdict_arrives_as_one_genai_evaluation_event_and_nothing_of_the_customer() -> None:
    metrics = MonitorMetrics(CollectorRegistry())
    with otlp_receiver() as receiver:
        config = OtelConfig(endpoint=receiver.url, flush_seconds=0.05)
        events = VerdictEvents(config, metrics.otel_dropped, headers={"x-scope-orgid": "tenant-7"})
        events.start()
        events.offer(
            traffic_verdict(), RecordOutcome(result_id=41, incident_id=17, change="opened", severity="high")
        )
        events.offer(
            traffic_verdict(kind="canary", verdict=Verdict.PASS, reason="", evidence={}, source=Source.PROBE)
        )
        events.offer(traffic_verdict(kind="boundary", verdict=Verdict.ERROR, reason="timeout", evidence={}))
        mismatch, passed, error = events_until(receiver, 3)
        events.stop()
    assert {e["event_name"] for e in (mismatch, passed, error)} == {EVENT_NAME}
    assert mismatch["attributes"] == {
        "gen_ai.evaluation.name": "traffic_tokens",
        "gen_ai.evaluation.score.label": "mismatch",
        "gen_ai.evaluation.score.value": 0.0,
        "gen_ai.evaluation.explanation": "prompt_tokens_low",
        "gen_ai.response.id": "chatcmpl-7Qx",
        "gen_ai.request.model": "glm-5.3",
        "kvcanary.target": "glm-prod",
        "kvcanary.node": "prefill-0",
        "kvcanary.source": "traffic",
        "kvcanary.certainty": "certain",
        "kvcanary.incident.id": 17,
        "kvcanary.result.id": 41,
    }
    assert mismatch["time"] == 1796551200 * 10**9 and mismatch["severity_text"] == "mismatch"
    assert mismatch["body"] is None and mismatch["scope"] == "kvcanary"
    assert mismatch["resource"]["service.name"] == "kvcanary" and mismatch["resource"]["service.instance.id"]
    assert passed["attributes"]["gen_ai.evaluation.score.value"] == 1.0
    assert (
        "gen_ai.response.id" not in passed["attributes"]
        and "kvcanary.incident.id" not in passed["attributes"]
    )
    # An error is no judgement: no score, the reason as the error's type.
    assert "gen_ai.evaluation.score.value" not in error["attributes"]
    assert error["attributes"]["error.type"] == "timeout"
    assert receiver.received[0].headers["x-scope-orgid"] == "tenant-7"
    raw = receiver.raw()
    for secret in ("Harriet", "Quayle", "4417", "team-blue", "merger", "rec-1"):
        assert secret.encode() not in raw, secret
    assert dropped(metrics, "queue_full") == dropped(metrics, "export_failed") == 0


def test_offer_never_waits_a_full_queue_drops_and_counts(tmp_path: Path) -> None:
    metrics = MonitorMetrics(CollectorRegistry())
    with otlp_receiver() as receiver:
        receiver.delay = 2.0  # a collector that hangs past the exporter's timeout
        config = OtelConfig(
            endpoint=receiver.url, max_queue=16, batch_size=4, flush_seconds=0.01, timeout_seconds=0.5
        )
        events = VerdictEvents(config, metrics.otel_dropped)
        events.start()
        started = time.perf_counter()
        for _ in range(2000):
            events.offer(traffic_verdict())
        elapsed = time.perf_counter() - started
        # An offer that waited for room would wait out an export (0.5 s per batch of 4): minutes in all.
        assert elapsed < 5, f"2,000 offers took {elapsed:.2f} s"
        assert dropped(metrics, "queue_full") >= 2000 - 16 - 4 * 2
        deadline = time.monotonic() + 20
        while dropped(metrics, "export_failed") == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        receiver.delay = 0.0
        events.stop(timeout=10)
    assert dropped(metrics, "export_failed") >= 4, "a batch the collector never answered counts"
    assert dropped(metrics, "queue_full") + dropped(metrics, "export_failed") <= 2000, "counted once each"


def test_a_collector_that_refuses_has_every_event_counted(tmp_path: Path) -> None:
    metrics = MonitorMetrics(CollectorRegistry())
    with otlp_receiver() as receiver:
        receiver.status = 400  # not retried by the exporter
        events = VerdictEvents(OtelConfig(endpoint=receiver.url, flush_seconds=0.05), metrics.otel_dropped)
        events.start()
        for _ in range(5):
            events.offer(traffic_verdict())
        events_until(receiver, 5)
        events.stop()
    assert dropped(metrics, "export_failed") == 5 and dropped(metrics, "queue_full") == 0


# --- configuration ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "endpoint"),
    [
        ("http://collector:4318", "http://collector:4318/v1/logs"),
        ("https://otlp.example.com/otlp/", "https://otlp.example.com/otlp/v1/logs"),
        ("http://collector:4318/v1/logs", "http://collector:4318/v1/logs"),
    ],
)
def test_the_endpoint_is_the_collectors_address_and_logs_is_added(given: str, endpoint: str) -> None:
    assert parse_settings({"otel": {"endpoint": given}}).otel == OtelConfig(endpoint=endpoint)


@pytest.mark.parametrize(
    ("otel", "named"),
    [
        ({"endpoint": "http://user:hunter2@collector:4318"}, "otel.endpoint: must not carry credentials"),
        ({"endpoint": "grpc://collector:4317"}, "otel.endpoint"),
        ({"endpoint": "http://c", "headers_env": "A", "headers_file": "/h"}, "otel: choose headers_env or"),
        ({"endpoint": "http://c", "max_queue": 1}, "otel.max_queue"),
        ({"endpoint": "http://c", "header": "x"}, "otel.header"),
        ({}, "otel.endpoint"),
    ],
)
def test_a_bad_otel_section_is_refused_naming_its_key(otel: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_settings({"otel": otel})
    assert named in str(caught.value) and "hunter2" not in str(caught.value)


def test_headers_come_from_a_variable_or_a_file_and_a_bad_one_names_the_key_not_the_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVC_OTEL_HEADERS", "Authorization=Bearer%20s3cret,x-scope-orgid=tenant-7")
    config = OtelConfig(endpoint="http://c:4318", headers_env="KVC_OTEL_HEADERS")
    assert otlp_headers(config) == {"Authorization": "Bearer s3cret", "x-scope-orgid": "tenant-7"}
    path = tmp_path / "headers"
    path.write_text("api-key=s3cret\n")
    assert otlp_headers(OtelConfig(endpoint="http://c:4318", headers_file=path)) == {"api-key": "s3cret"}
    monkeypatch.setenv("KVC_OTEL_HEADERS", "Bearer s3cret")
    with pytest.raises(ConfigError, match=r"otel\.headers_env: entry 1 is not NAME=VALUE") as caught:
        otlp_headers(config)
    assert "s3cret" not in str(caught.value)
    monkeypatch.delenv("KVC_OTEL_HEADERS")
    with pytest.raises(ConfigError, match=r"otel\.headers_env: the variable KVC_OTEL_HEADERS is not set"):
        otlp_headers(config)
    with pytest.raises(ConfigError, match=r"otel\.headers_file: cannot read"):
        otlp_headers(OtelConfig(endpoint="http://c:4318", headers_file=tmp_path / "absent"))


def test_a_serve_whose_headers_variable_is_unset_exits_2_naming_it(
    served: Callable[..., Served],  # noqa: F811
) -> None:
    monitor = served({"otel": {"endpoint": "http://127.0.0.1:9/", "headers_env": "KVC_OTEL_UNSET"}})
    monitor.migrate()
    done = monitor.kvcanary("serve", "--config", str(monitor.config_path))
    assert done.returncode == 2 and "otel.headers_env" in done.stderr, done.stderr


# --- end to end -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_served_monitors_probe_and_traffic_verdicts_reach_the_collector(
    served: Callable[..., Served],  # noqa: F811
    start_worker: Callable[..., WorkerProcess],
) -> None:
    worker = start_worker()
    ingest = secrets.token_urlsafe(24)
    header = secrets.token_urlsafe(16)
    with otlp_receiver() as receiver:
        monitor = served({
            "targets": [reference_target("ref", worker.url, probes=["canary"], interval_seconds=2)],
            "otel": {"endpoint": receiver.url, "headers_env": "KVC_OTEL_HEADERS", "flush_seconds": 0.2},
        })  # fmt: skip
        monitor.env.update(
            {"KVCANARY_INGEST_TOKEN": ingest, "KVC_OTEL_HEADERS": f"authorization=Bearer {header}"}
        )
        monitor.start()

        def named(name: str, label: str) -> dict[str, Any] | None:
            return next(
                (e for e in receiver.events() if e["attributes"].get("gen_ai.evaluation.name") == name
                 and e["attributes"].get("gen_ai.evaluation.score.label") == label),
                None,
            )  # fmt: skip

        canary = monitor.wait_for("a canary's event", lambda: named("canary", "pass"))
        # A customer's exchange through a gateway, summarised by the real tap: a prompt of 4,320
        # characters that the engine says was one token (the incident's signature).
        exchange = Exchange(
            request_id="chatcmpl-otel-1", started=time.time(), caller="team-blue", caller_kind="team",
            api_base=worker.url + "/v1", model="kvcanary-reference", prompt=CUSTOMER_PROMPT, messages=1,
            response=CUSTOMER_ANSWER, prompt_tokens=1, completion_tokens=14, latency_seconds=0.2,
        )  # fmt: skip
        record = summarize(exchange, Fingerprinter(secrets.token_bytes(32)))
        body = {"version": VERSION, "gateway": "gw-otel", "records": [record]}
        posted = httpx.post(
            monitor.url + "/api/v1/traffic",
            json=body,
            headers={"Authorization": f"Bearer {ingest}"},
            timeout=30,
        )
        assert posted.status_code in (200, 202), posted.text
        tokens = monitor.wait_for("the tokens check's event", lambda: named("traffic_tokens", "mismatch"))
        dropped_total = monitor.value("kvcanary_otel_events_dropped_total")
        monitor.stop()
    assert canary["event_name"] == tokens["event_name"] == EVENT_NAME
    assert (
        canary["attributes"]["kvcanary.target"] == "ref"
        and canary["attributes"]["kvcanary.source"] == "probe"
    )
    assert (
        canary["attributes"]["gen_ai.evaluation.score.value"] == 1.0
        and canary["attributes"]["kvcanary.result.id"]
    )
    attributes = tokens["attributes"]
    assert attributes["gen_ai.response.id"] == "chatcmpl-otel-1"
    assert attributes["gen_ai.evaluation.score.value"] == 0.0 and attributes["gen_ai.evaluation.explanation"]
    assert attributes["kvcanary.source"] == "traffic" and attributes["kvcanary.target"] == "ref"
    incidents = monitor_incidents(monitor)
    assert attributes["kvcanary.incident.id"] in incidents
    assert receiver.received[0].headers["authorization"] == f"Bearer {header}"
    raw = receiver.raw()
    for secret in (
        "Harriet",
        "Quayle",
        "4417-2210",
        "merger",
        "team-blue",
        monitor.token,
        ingest,
        *KEYS.values(),
    ):
        assert secret.encode() not in raw, secret
    assert dropped_total == 0


def monitor_incidents(monitor: Served) -> set[int]:
    """Return the ids of the incidents the monitor recorded (it is stopped: read from its database)."""
    import sqlite3

    path = monitor.config["database_url"].removeprefix("sqlite:///")
    with sqlite3.connect(path) as db:
        return {row[0] for row in db.execute("SELECT id FROM incident")}


def test_the_dropped_counter_is_exported_at_zero_for_both_reasons() -> None:
    page = MonitorMetrics(CollectorRegistry()).exposition().decode()
    samples = {
        s.labels["reason"]: s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name == "kvcanary_otel_events_dropped_total"
    }
    assert samples == {"queue_full": 0.0, "export_failed": 0.0}


def test_the_examples_commented_otel_block_is_valid_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (REPO / "kvcanary.example.yml").read_text()
    block = text[text.index("# otel:") :].splitlines()
    # The block's keys, uncommented; its alternatives (`#   # headers_file: ...`) stay comments.
    lines = [ln.removeprefix("# ") for ln in block if ln.startswith("# ") and not ln.startswith("#   #")]
    otel = parse_settings(yaml.safe_load("\n".join(lines))).otel
    assert otel is not None and otel.endpoint == "http://otel-collector:4318/v1/logs"
    monkeypatch.setenv(otel.headers_env or "", "api-key=x")
    assert otlp_headers(otel) == {"api-key": "x"}
