"""The alerting rules are code: checked and unit-tested by the real promtool, and held to the contracts.

- ``promtool check rules --lint=all --lint-fatal`` and ``promtool test rules`` on ``alerts/``.
- Every rule has a severity from the fixed set, a summary, a description and a runbook_url whose file
  exists; every runbook belongs to a rule or to an alert the monitor pushes itself.
- Every rule has at least one firing and one non-firing promtool case.
- Every metric a rule reads is a row of docs/monitor-metrics.md or docs/worker-metrics.md.

promtool missing: skipped, or failed when ``KVCANARY_REQUIRE_PROMETHEUS=1`` (as CI sets it).
"""

from __future__ import annotations

import re
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.alerts import (
    ALERTS,
    ALWAYS_FIRING,
    PUSHED_ALERTS,
    RECORDED,
    REPO,
    RULE_FILES,
    RUNBOOKS,
    TEST_FILES,
    require_tool,
)
from tests.support.pace import PROCESS_SECONDS

#: promtool's verdict is judged, never its time: a bound only for a promtool that hangs. The SLO
#: file's 25-hour histories cost about 67 s of CPU; it took 214 s beside one suite on two cores, and
#: over 300 s (the bound before) in each of two suites run side by side (a load of 20-30).
PROMTOOL_SECONDS = 4 * PROCESS_SECONDS

SEVERITIES = {"critical", "high", "warning", "none"}
# A page that means tenant data crossed, or was about to: these runbooks say what the disclosure needs.
LEAK_CLASS = {
    "KVCanaryLeak",
    "KVCanaryLeakDetected",
    "KVCanaryOwnershipViolation",
    "KVCanaryPlaceholderSubstitution",
    "KVCanaryDirtyPageReuse",
}
CONTRACTS = (REPO / "docs" / "monitor-metrics.md", REPO / "docs" / "worker-metrics.md")
CAMEL_CASE = re.compile(r"^[A-Z][A-Za-z0-9]+$")


def load_rules() -> list[dict[str, Any]]:
    """Return every alerting rule of ``alerts/*.rules.yml``, each with its group's name under ``group``."""
    rules = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            rules += [{**rule, "group": group["name"]} for rule in group["rules"] if "alert" in rule]
    return rules


def alert_rule_tests() -> list[dict[str, Any]]:
    """Return every ``alert_rule_test`` case of ``alerts/tests/*.test.yml``."""
    cases = []
    for path in TEST_FILES:
        for test in yaml.safe_load(path.read_text())["tests"]:
            cases += test.get("alert_rule_test", [])
    return cases


# --- metric names in PromQL ---------------------------------------------------------------------------

_STRINGS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_OFFSETS = re.compile(r"\boffset\s+-?[0-9a-z]+|@\s*(?:start\s*\(\s*\)|end\s*\(\s*\)|[0-9.]+)")
# A whole identifier (not part of a number or of a longer name) that is not called like a function.
_IDENTIFIER = re.compile(r"(?<![\w.:])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = {"and", "or", "unless", "bool", "group_left", "group_right", "offset", "inf", "nan"}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def metric_names(expr: str) -> set[str]:
    """Return the metric names ``expr`` selects.

    Strings, label matchers, label lists of by/without/on/ignoring/group_*, ranges and offsets are
    removed first, so label names and values never count; function and aggregation names are
    recognised by the parenthesis that follows them.
    """
    for pattern in (_STRINGS, _MATCHERS, _LABEL_LISTS, _RANGES, _OFFSETS):
        expr = pattern.sub(" ", expr)
    return {m for m in _IDENTIFIER.findall(expr) if m.lower() not in _KEYWORDS}


def documented_metrics() -> set[str]:
    """Return the metric names in the first column of the two contract tables."""
    row = re.compile(r"^\|\s*`([a-z_:][a-z0-9_:]*)`\s*\|", re.MULTILINE)
    return {name for path in CONTRACTS for name in row.findall(path.read_text())}


def undocumented(names: set[str], documented: set[str]) -> set[str]:
    """Return the names that are neither documented nor a documented histogram's series."""
    missing = set()
    for name in names - documented:
        base = next((name.removesuffix(s) for s in _HISTOGRAM_SUFFIXES if name.endswith(s)), None)
        if base is None or base not in documented:
            missing.add(name)
    return missing


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (target, probe) (increase(a_total{verdict="leak",x=~"b|c"}[10m])) > 0', {"a_total"}),
        (
            "time() - max by (t) (b_seconds) > 3 * max without (instance) (c_seconds)",
            {"b_seconds", "c_seconds"},
        ),
        ("x / on (instance, job) group_right y < 1e3 and z offset 5m", {"x", "y", "z"}),
        ('absent(up{job="a{b}"}) or vector(1) unless sum(rate(h_bucket[5m:1m])) by (le)', {"up", "h_bucket"}),
        ("histogram_quantile(0.9, sum by (le) (rate(d_seconds_bucket[5m]))) > Inf", {"d_seconds_bucket"}),
    ],
)
def test_metric_names_sees_metrics_and_not_functions_labels_or_numbers(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_histogram_series_count_as_their_documented_histogram() -> None:
    documented = {"kvcanary_probe_duration_seconds"}
    assert undocumented({"kvcanary_probe_duration_seconds_bucket"}, documented) == set()
    assert undocumented({"kvcanary_probe_duration_bucket"}, documented) == {"kvcanary_probe_duration_bucket"}


# --- the real tools -----------------------------------------------------------------------------------


def test_promtool_checks_the_rule_files_with_every_lint_fatal() -> None:
    promtool = require_tool("promtool")
    run = subprocess.run(
        [promtool, "check", "rules", "--lint=all", "--lint-fatal", *map(str, RULE_FILES)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: p.name)
def test_promtool_unit_tests_pass(path: Path) -> None:
    """One file a test, so that parallel workers share them (the SLOs' take the longest: long histories)."""
    promtool = require_tool("promtool")
    run = subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=PROMTOOL_SECONDS
    )
    assert run.returncode == 0, run.stdout + run.stderr


# --- what every rule must carry -----------------------------------------------------------------------


def test_there_are_rule_files_and_test_files() -> None:
    assert RULE_FILES and TEST_FILES and load_rules()


@pytest.mark.parametrize("rule", load_rules(), ids=lambda r: f"{r['alert']}-{r['labels'].get('reason', '')}")
def test_every_rule_is_named_labelled_and_annotated(rule: dict[str, Any]) -> None:
    assert CAMEL_CASE.match(rule["alert"]) and rule["alert"].startswith("KVCanary")
    assert rule["labels"]["severity"] in SEVERITIES
    for key in ("summary", "description", "runbook_url"):
        assert str(rule["annotations"].get(key, "")).strip(), f"{rule['alert']}: no {key}"
    assert "$value" not in rule["annotations"]["summary"], "summaries stay stable while the alert fires"


def test_rules_sharing_a_name_differ_by_a_reason_label() -> None:
    seen: dict[tuple[str, str | None], int] = defaultdict(int)
    for rule in load_rules():
        seen[(rule["alert"], rule["labels"].get("reason"))] += 1
    assert {key: n for key, n in seen.items() if n > 1} == {}


def test_every_runbook_url_points_at_its_own_runbook_under_one_base() -> None:
    bases = set()
    for rule in load_rules():
        url = rule["annotations"]["runbook_url"]
        match = re.fullmatch(r"(https?://\S+/)([A-Za-z0-9]+)(?:\.md)?", url)
        assert match, url
        assert match.group(2) == rule["alert"], f"{rule['alert']} links to {url}"
        assert (RUNBOOKS / f"{rule['alert']}.md").is_file(), f"no alerts/runbooks/{rule['alert']}.md"
        bases.add(match.group(1))
    assert len(bases) == 1, f"runbook_url bases differ: {sorted(bases)}"


def test_every_runbook_belongs_to_a_rule_or_a_pushed_alert() -> None:
    names = {path.stem for path in RUNBOOKS.glob("*.md")}
    assert names - (ALERTS | PUSHED_ALERTS) == set(), "runbooks for no alert"
    assert (ALERTS | PUSHED_ALERTS) - names == set(), "alerts without a runbook"


@pytest.mark.parametrize("name", sorted(ALERTS | PUSHED_ALERTS))
def test_every_runbook_has_the_on_call_sections(name: str) -> None:
    text = (RUNBOOKS / f"{name}.md").read_text()
    headings = set(re.findall(r"^## (.+)$", text, re.MULTILINE))
    assert text.startswith(f"# {name}\n")
    assert {"What it means", "Confirm"} <= headings
    assert headings & {"Stop the bleeding", "Fix"}, "no section saying what to do"
    if name in LEAK_CLASS:
        assert {"Stop the bleeding", "Collect for the disclosure"} <= headings


def test_the_readme_table_lists_every_alert() -> None:
    readme = (REPO / "alerts" / "README.md").read_text()
    rows = set(re.findall(r"^\|\s*\[?`?(KVCanary\w+)", readme, re.MULTILINE))
    assert (ALERTS | PUSHED_ALERTS) - rows == set()


# --- promtool coverage --------------------------------------------------------------------------------


def test_every_rule_has_a_firing_and_a_non_firing_promtool_case() -> None:
    firing: dict[str, list[dict[str, str]]] = defaultdict(list)
    quiet: set[str] = set()
    for case in alert_rule_tests():
        expected = case.get("exp_alerts") or []
        if not expected:
            quiet.add(case["alertname"])
        for alert in expected:
            firing[case["alertname"]].append(alert.get("exp_labels") or {})
            annotations = alert.get("exp_annotations") or {}
            assert {"summary", "runbook_url"} <= annotations.keys(), f"{case['alertname']}: {annotations}"
    for rule in load_rules():
        static = {k: str(v) for k, v in rule["labels"].items()}
        assert any(static.items() <= labels.items() for labels in firing[rule["alert"]]), (
            f"no firing case for {rule['alert']} {static}"
        )
        if rule["alert"] not in ALWAYS_FIRING:
            assert rule["alert"] in quiet, f"no non-firing case for {rule['alert']}"


def test_only_the_watchdog_is_exempt_from_a_non_firing_case() -> None:
    assert {r["alert"] for r in load_rules() if r["expr"].strip() == "vector(1)"} == ALWAYS_FIRING


# --- the metrics contract -----------------------------------------------------------------------------


def test_every_metric_a_rule_reads_is_in_a_metrics_contract() -> None:
    assert len(documented_metrics()) > 20, "the contract tables were not parsed"
    documented = documented_metrics() | RECORDED
    missing = {
        rule["alert"]: sorted(undocumented(metric_names(rule["expr"]), documented))
        for rule in load_rules()
        if undocumented(metric_names(rule["expr"]), documented)
    }
    assert missing == {}, f"not in {', '.join(str(p.relative_to(REPO)) for p in CONTRACTS)}"


def test_every_test_file_loads_the_rules_it_tests() -> None:
    for path in TEST_FILES:
        rule_files = yaml.safe_load(path.read_text())["rule_files"]
        resolved = {(path.parent / Path(f)).resolve() for f in rule_files}
        assert resolved <= {p.resolve() for p in RULE_FILES}, path.name


# --- the PromQL the runbooks tell people to paste -----------------------------------------------------

#: Series Prometheus makes itself; a runbook may query them beside the contracts.
PROMETHEUS_SERIES = {"up", "ALERTS"}


def runbook_queries() -> list[tuple[str, str]]:
    """Return ``(runbook, expression)`` for every expression in a promql block of a runbook.

    Expressions in one block are separated by blank lines; ``#`` comment lines are dropped.
    """
    found = []
    for path in sorted(RUNBOOKS.glob("*.md")):
        for block in re.findall(r"```promql\n(.*?)```", path.read_text(), re.DOTALL):
            for chunk in re.split(r"\n\s*\n", block):
                expr = "\n".join(line for line in chunk.splitlines() if not line.lstrip().startswith("#"))
                if expr.strip():
                    found.append((path.stem, expr.strip()))
    return found


def test_every_runbook_query_parses(tmp_path: Path) -> None:
    queries = runbook_queries()
    assert len(queries) >= len(ALERTS), "runbooks lost their PromQL"
    promtool = require_tool("promtool")
    # Evaluated on no data: `> Inf` keeps any vector empty, so only a parse or type error can fail.
    cases = [{"expr": f"({expr}) > Inf", "eval_time": "1m", "exp_samples": []} for _, expr in queries]
    spec = {"rule_files": [], "tests": [{"interval": "1m", "input_series": [], "promql_expr_test": cases}]}
    path = tmp_path / "runbook_queries.test.yml"
    path.write_text(yaml.safe_dump(spec))
    run = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_runbook_query_reads_only_documented_metrics() -> None:
    documented = documented_metrics() | PROMETHEUS_SERIES | RECORDED
    missing = [(name, sorted(undocumented(metric_names(e), documented))) for name, e in runbook_queries()]
    assert [(name, names) for name, names in missing if names] == []
