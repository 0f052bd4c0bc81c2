"""What the dashboard tests read: the panels of a dashboard, its variables' selectors, the two
metric contracts (docs/monitor-metrics.md, docs/worker-metrics.md), and what the rule files record."""

from __future__ import annotations

import re
from typing import Any

import yaml

from tests.support.paths import REPO

CONTRACTS = (REPO / "docs" / "monitor-metrics.md", REPO / "docs" / "worker-metrics.md")
# A table row of a contract: | `kvcanary_name` | type | labels | ...
_ROW = re.compile(r"^\|\s*`(kvcanary_\w+)`\s*\|[^|]*\|(?P<labels>[^|]*)\|", re.MULTILINE)
# A label name in the labels cell: a backticked identifier at the start or after a comma.
_LABEL = re.compile(r"(?:^|,)\s*`([a-z_]\w*)`")


def documented_metrics() -> dict[str, set[str]]:
    """Return {metric name: its labels} from the tables of docs/monitor-metrics.md and worker-metrics.md."""
    metrics: dict[str, set[str]] = {}
    for doc in CONTRACTS:
        for row in _ROW.finditer(doc.read_text(encoding="utf-8")):
            metrics[row.group(1)] = set(_LABEL.findall(row.group("labels").strip()))
    return metrics


#: The rule files a Prometheus loads beside the dashboards (alerts/README.md).
RULE_FILES = sorted((REPO / "alerts").glob("*.rules.yml"))


def recorded_series() -> set[str]:
    """Return the series the rule files record (the SLOs' ``slo:*``): a panel may read them beside the
    contracts, where Prometheus loads the rules."""
    return {
        rule["record"]
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]
        for rule in group["rules"]
        if "record" in rule
    }


def variable_selector(query: str) -> str:
    """Return the series selector of a ``label_values(selector, label)`` variable query."""
    match = re.fullmatch(r"label_values\((.+),\s*\w+\)", query.strip())
    assert match, f"not label_values(selector, label): {query!r}"
    return match.group(1)


def all_panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return every panel, rows and the panels of collapsed rows included."""
    found = []
    for panel in panels:
        found.append(panel)
        found.extend(all_panels(panel.get("panels") or []))
    return found
