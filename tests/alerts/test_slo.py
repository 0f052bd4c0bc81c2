"""The SLO rules (alerts/kvcanary.slo.rules.yml) hold together: the windows and burn rates are the SRE
workbook's, every threshold is its factor times the objective's budget, each SLO records every window
Sloth does under Sloth's labels, and the recording rules read only contract metrics.

That each alert fires at its burn rate and stays quiet below it is alerts/tests/slo.test.yml, run by
``promtool test rules`` in test_rules.py.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from tests.alerts import ALERTS_DIR, RECORDED
from tests.alerts.test_rules import documented_metrics, metric_names, undocumented

SLO_FILE = ALERTS_DIR / "kvcanary.slo.rules.yml"
#: sloth_id -> (the alert, the objective it states).
SLOS = {
    "kvcanary-correctness": ("KVCanaryCorrectnessBudgetBurn", 0.999),
    "kvcanary-coverage": ("KVCanaryCoverageBudgetBurn", 0.99),
}
WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d", "30d")
#: The SRE workbook's multi-window, multi-burn-rate pairs: (short, long, factor) by alert reason.
PAIRS = {
    "fast_burn": [("5m", "1h", 14.4), ("30m", "6h", 6.0)],
    "slow_burn": [("2h", "1d", 3.0), ("6h", "3d", 1.0)],
}
SEVERITY = {"fast_burn": ("high", "page"), "slow_burn": ("warning", "ticket")}
_TERM = re.compile(r'slo:sli_error:ratio_rate(\w+)\{sloth_id="([^"]+)"\}\s*>\s*\(([\d.]+)\s*\*\s*([\d.]+)\)')


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(SLO_FILE.read_text())["groups"] for rule in group["rules"]]


def records(name: str) -> list[dict[str, Any]]:
    return [rule for rule in rules() if rule.get("record") == name]


def test_each_slo_records_every_window_under_sloths_labels() -> None:
    for sloth_id in SLOS:
        slo = sloth_id.removeprefix("kvcanary-")
        found = {
            rule["labels"]["sloth_window"]
            for name in {f"slo:sli_error:ratio_rate{w}" for w in WINDOWS}
            for rule in records(name)
            if rule["labels"]["sloth_id"] == sloth_id
        }
        assert found == set(WINDOWS), sloth_id
        for rule in rules():
            labels = rule.get("labels") or {}
            if labels.get("sloth_id") == sloth_id:
                assert labels["sloth_service"] == "kvcanary" and labels["sloth_slo"] == slo, rule


@pytest.mark.parametrize("sloth_id", sorted(SLOS))
def test_the_objective_and_its_budget_are_stated_once_and_agree(sloth_id: str) -> None:
    objective = SLOS[sloth_id][1]
    stated = {
        rule["record"]: rule["expr"].strip()
        for rule in rules()
        if "record" in rule and (rule.get("labels") or {}).get("sloth_id") == sloth_id
    }
    assert stated["slo:objective:ratio"] == f"vector({objective})"
    assert stated["slo:error_budget:ratio"] == f"vector(1 - {objective})"
    assert stated["slo:time_period:days"] == "vector(30)"
    info = next(r for r in records("sloth_slo_info") if r["labels"]["sloth_id"] == sloth_id)
    assert float(info["labels"]["sloth_objective"]) == pytest.approx(objective * 100)


@pytest.mark.parametrize("sloth_id", sorted(SLOS))
def test_every_burn_alert_pairs_the_workbooks_windows_at_its_factor_of_the_budget(sloth_id: str) -> None:
    alert, objective = SLOS[sloth_id]
    budget = 1 - objective
    burns = [rule for rule in rules() if rule.get("alert") == alert]
    assert sorted(rule["labels"]["reason"] for rule in burns) == sorted(PAIRS)
    for rule in burns:
        reason = rule["labels"]["reason"]
        assert (rule["labels"]["severity"], rule["labels"]["sloth_severity"]) == SEVERITY[reason]
        terms = _TERM.findall(rule["expr"])
        assert {term[1] for term in terms} == {sloth_id}, rule["expr"]
        assert all(float(term[3]) == pytest.approx(budget) for term in terms), rule["expr"]
        # Each pair: the short window, then the long one, at the same factor, joined by `and`.
        pairs = [(terms[i][0], terms[i + 1][0], float(terms[i][2])) for i in range(0, len(terms), 2)]
        assert pairs == PAIRS[reason], rule["expr"]
        assert all(float(terms[i][2]) == float(terms[i + 1][2]) for i in range(0, len(terms), 2))
        assert re.findall(r"^\s*(and|or)\s*$", rule["expr"], re.MULTILINE) == ["and", "or", "and"]
        assert "for" not in rule, "the short window is the hold: a `for` only delays the page"


def test_every_recording_rule_reads_contract_metrics_or_what_a_rule_records() -> None:
    known = documented_metrics() | RECORDED
    missing = {
        rule["record"]: sorted(undocumented(metric_names(rule["expr"]), known))
        for rule in rules()
        if "record" in rule and undocumented(metric_names(rule["expr"]), known)
    }
    assert missing == {}


def test_the_correctness_sli_leaves_errors_out_of_both_sides() -> None:
    for rule in records("slo:sli_error:ratio_rate5m"):
        if rule["labels"]["sloth_id"] == "kvcanary-correctness":
            bad, total = rule["expr"].split("\n/\n")
            assert 'verdict=~"leak|mismatch"' in bad and 'verdict=~"pass|leak|mismatch"' in total
            assert "error" not in rule["expr"]
