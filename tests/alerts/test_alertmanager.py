"""``alerts/alertmanager.example.yml``: valid for amtool, routes by severity, and inhibits as documented.

The routing is checked with ``amtool config routes test``; the inhibition rules on a real
Alertmanager (``prometheus-alertmanager``) started on loopback with the example config, by posting
alerts and reading back which ones it reports as inhibited.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from tests.alerts import ALERTMANAGER_EXAMPLE, require_tool


def test_amtool_accepts_the_example_config() -> None:
    amtool = require_tool("amtool", "prometheus-alertmanager")
    run = subprocess.run(
        [amtool, "check-config", str(ALERTMANAGER_EXAMPLE)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize(
    ("labels", "receivers"),
    [
        ({"alertname": "KVCanaryWatchdog", "severity": "none"}, "deadmans-switch"),
        ({"alertname": "KVCanaryLeak", "severity": "critical", "target": "glm-prod"}, "pager"),
        ({"alertname": "KVCanaryOwnershipViolation", "severity": "critical"}, "pager"),
        ({"alertname": "KVCanaryMismatch", "severity": "high", "target": "glm-prod"}, "pager,ticket"),
        ({"alertname": "KVCanaryProbeErrors", "severity": "warning", "target": "glm-prod"}, "ticket,chat"),
        ({"alertname": "SomethingElse", "severity": "none"}, "blackhole"),
        ({"alertname": "SomethingElse"}, "chat"),
    ],
)
def test_alerts_route_by_severity_and_the_watchdog_to_the_dead_mans_switch(
    labels: dict[str, str], receivers: str
) -> None:
    amtool = require_tool("amtool", "prometheus-alertmanager")
    run = subprocess.run(
        [amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER_EXAMPLE}",
         *(f"{k}={v}" for k, v in labels.items())],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == receivers


def alert_labels(alertname: str, severity: str, **more: str) -> dict[str, str]:
    return {"alertname": alertname, "severity": severity, **more}


@pytest.mark.external_service
def test_a_leak_inhibits_its_targets_noise_and_the_monitors_push_wins_over_the_rule(tmp_path: Path) -> None:
    require_tool("prometheus-alertmanager", "prometheus-alertmanager")
    from tests.support.services import start_alertmanager

    am = start_alertmanager(tmp_path / "am", config=yaml.safe_load(ALERTMANAGER_EXAMPLE.read_text()))
    try:
        alerts = [
            alert_labels("KVCanaryLeak", "critical", target="glm-prod", probe="cross_tenant"),
            alert_labels("KVCanaryLeakDetected", "critical", target="glm-prod", probe="cross_tenant"),
            alert_labels("KVCanaryProbeErrors", "warning", target="glm-prod", probe="canary"),
            alert_labels("KVCanaryProbeErrors", "warning", target="vllm-b", probe="canary"),
            alert_labels("KVCanaryOutputMismatch", "high", target="vllm-b", probe="boundary"),
            alert_labels("KVCanaryPlaceholderSubstitution", "critical", instance="gpu-1:30000", job="w"),
        ]
        response = httpx.post(am.url + "/api/v2/alerts", json=[{"labels": a} for a in alerts], timeout=5)
        assert response.status_code == 200, response.text
        got = {
            (a["labels"]["alertname"], a["labels"].get("target") or a["labels"].get("instance")): bool(
                a["status"]["inhibitedBy"]
            )
            for a in am.alerts()
        }
    finally:
        am.stop()
    assert got == {
        ("KVCanaryLeak", "glm-prod"): False,
        ("KVCanaryLeakDetected", "glm-prod"): True,
        ("KVCanaryProbeErrors", "glm-prod"): True,
        ("KVCanaryProbeErrors", "vllm-b"): False,
        ("KVCanaryOutputMismatch", "vllm-b"): False,
        ("KVCanaryPlaceholderSubstitution", "gpu-1:30000"): False,
    }
