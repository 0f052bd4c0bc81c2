"""The deploy gate on the incident's own configuration, as an operator runs it: ``kvcanary check``.

A prefill node of SGLang 0.5.11 in disaggregated mode, advertising a 1,048,576-token context window
on a 681,280-token pool (the node is an SGLang stub at the network seam: tests/support/sglang_stub.py).
The gate must report the capacity mismatch and the version defect with their figures without
sending one completion, then the boundary probe's verdict; the fixed node (0.5.22, a pool of about
2.1 M tokens) must pass all three.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import REPO
from tests.support.sglang_stub import SGLangStub, start_sglang_stub


@pytest.fixture
def incident_node() -> Iterator[SGLangStub]:
    stub = start_sglang_stub("sglang-0.5.11-prefill-incident.json")
    yield stub
    stub.stop()


@pytest.fixture
def fixed_node() -> Iterator[SGLangStub]:
    stub = start_sglang_stub("sglang-0.5.22-prefill-fixed.json")
    yield stub
    stub.stop()


def check(tmp_path: Path, node: SGLangStub, probes: list[str]) -> tuple[int, dict[str, dict[str, Any]]]:
    config = {
        "api": {"local_only": True},
        "targets": [
            {
                "name": "glm-prod",
                "base_url": node.url,
                "engine": "sglang",
                "model": "glm",
                "tenants": [{"name": "tenant-a"}, {"name": "tenant-b"}],
                "probes": probes,
                "timeout_seconds": 120,
            }
        ],
    }
    path = tmp_path / "kvcanary.yml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [sys.executable, "-m", "monitor", "check", "--config", str(path), "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode, {line["probe"]: line for line in lines}


def test_the_incidents_node_fails_the_gate_on_capacity_and_version_without_a_completion(
    tmp_path: Path, incident_node: SGLangStub
) -> None:
    code, found = check(tmp_path, incident_node, ["capacity", "version"])
    assert code == 1
    assert (found["capacity"]["verdict"], found["capacity"]["reason"]) == (
        "mismatch",
        "pool_below_context_window",
    )
    assert "681,280 tokens against a context window of 1,048,576 (0.65x)" in found["capacity"]["detail"]
    assert (found["version"]["verdict"], found["version"]["reason"]) == ("mismatch", "known_isolation_defect")
    assert "sglang-pd-placeholder-30233" in found["version"]["detail"]
    assert "0.5.11" in found["version"]["detail"] and "0.5.22" in found["version"]["detail"]
    assert incident_node.completions == 0  # zero requests: what the node publishes is enough


def test_the_boundary_probe_sees_the_placeholder_answer(tmp_path: Path, incident_node: SGLangStub) -> None:
    code, found = check(tmp_path, incident_node, ["capacity", "version", "boundary"])
    assert code == 1
    boundary = found["boundary"]
    assert (boundary["verdict"], boundary["reason"]) == ("mismatch", "accepted_over_capacity")
    assert "reported 1 prompt tokens" in boundary["detail"]


def test_the_fixed_node_passes_all_three(tmp_path: Path, fixed_node: SGLangStub) -> None:
    code, found = check(tmp_path, fixed_node, ["capacity", "version", "boundary"])
    assert code == 0, found
    assert {p: f["verdict"] for p, f in found.items()} == {
        "capacity": "pass",
        "version": "pass",
        "boundary": "pass",
    }
    assert found["boundary"]["reason"] == "refused_over_capacity"
