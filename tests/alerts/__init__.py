"""Tests of ``alerts/``: Prometheus rules, their promtool tests, runbooks and the Alertmanager example."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent.parent
ALERTS_DIR = REPO / "alerts"
RUNBOOKS = ALERTS_DIR / "runbooks"
RULE_FILES = sorted(ALERTS_DIR.glob("*.rules.yml"))
TEST_FILES = sorted((ALERTS_DIR / "tests").glob("*.test.yml"))
ALERTMANAGER_EXAMPLE = ALERTS_DIR / "alertmanager.example.yml"

#: Alerts the monitor posts to Alertmanager itself (API v2), from its own incidents; no rule makes them.
#: KVCanaryProbeErrors is also a Prometheus rule: same meaning, same runbook, Prometheus later.
PUSHED_ALERTS = frozenset({"KVCanaryLeak", "KVCanaryMismatch", "KVCanaryProbeErrors"})
#: Rules that fire by design at every evaluation, so no promtool case can show them quiet.
ALWAYS_FIRING = frozenset({"KVCanaryWatchdog"})
#: Every alert name the rule files define.
ALERTS = frozenset(
    rule["alert"]
    for path in RULE_FILES
    for group in yaml.safe_load(path.read_text())["groups"]
    for rule in group["rules"]
    if "alert" in rule
)
#: Every series the rule files record (the SLOs' ``slo:*`` and ``target:*``): a rule, a runbook or a
#: panel may read them beside the metric contracts.
RECORDED = frozenset(
    rule["record"]
    for path in RULE_FILES
    for group in yaml.safe_load(path.read_text())["groups"]
    for rule in group["rules"]
    if "record" in rule
)


def require_tool(name: str, package: str | None = None) -> str:
    """Return the path of ``name`` on PATH; skip without it, or fail when KVCANARY_REQUIRE_PROMETHEUS=1."""
    path = shutil.which(name)
    if path:
        return path
    hint = f"{name} is not on PATH (Debian: apt-get install {package or 'prometheus'})"
    if os.environ.get("KVCANARY_REQUIRE_PROMETHEUS") == "1":
        pytest.fail(f"{hint}, and KVCANARY_REQUIRE_PROMETHEUS=1 requires it")
    pytest.skip(f"{hint}; set KVCANARY_REQUIRE_PROMETHEUS=1 to fail instead of skipping")
