"""The monitor's deploy gate, ``python -m monitor check``, against a real vLLM server.

The CLI runs as a subprocess with the project's Python, as an operator would run it, on a config
written here. What a random-weight model makes each probe say:

- ``boundary`` passes: vLLM itself refuses the 1,025-token prompt with its 400 (a real engine's
  error body, read right).
- ``canary`` is a ``mismatch`` with reason ``nonce_missing``: the model cannot repeat a nonce.
  That it gets that far, not ``error``, shows that a real engine's streaming, usage and answers
  were read right; with a real model the same probe passes.
- Nothing is a ``leak``: vLLM does not share KV pages across these tenants, and junk text holds no
  other tenant's marker.

So the gate exits 1 (a mismatch), not 0, 2 or 3.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO
from tests.support.vllm import VllmServer

pytestmark = pytest.mark.vllm

EXIT_FAILED = 1
CHECK_TIMEOUT_S = 120


def write_config(tmp_path: Path, server: VllmServer) -> Path:
    config = {
        "database_url": f"sqlite:///{tmp_path / 'kvcanary.db'}",
        "api": {"listen": "127.0.0.1:0", "local_only": True},
        "targets": [
            {
                "name": "vllm-cpu",
                "base_url": server.url,
                "engine": "vllm",
                "model": server.model_name,
                "tenants": [{"name": "tenant-a"}, {"name": "tenant-b"}],
                "probes": ["canary", "cross_tenant", "boundary"],
            }
        ],
    }
    path = tmp_path / "kvcanary.yml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return path


def run_check(config: Path) -> tuple[int, list[dict[str, Any]], str]:
    """Run the gate; return its exit code, its JSON lines and everything it printed (for messages)."""
    done = subprocess.run(
        [sys.executable, "-m", "monitor", "check", "--config", str(config), "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=CHECK_TIMEOUT_S, check=False,
    )  # fmt: skip
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return (
        done.returncode,
        rows,
        f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}",
    )


@pytest.fixture(scope="module")
def check_result(
    vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, dict[str, dict[str, Any]], str]:
    code, rows, printed = run_check(write_config(tmp_path_factory.mktemp("check"), vllm_server))
    by_probe = {row["probe"]: row for row in rows}
    assert all(row["target"] == "vllm-cpu" for row in rows), printed
    assert sorted(by_probe) == ["boundary", "canary", "cross_tenant"], printed
    return code, by_probe, printed


def test_boundary_passes_on_vllms_own_refusal(check_result: tuple[int, dict[str, Any], str]) -> None:
    _, rows, printed = check_result
    assert rows["boundary"]["verdict"] == "pass", printed


def test_no_probe_reports_a_leak(check_result: tuple[int, dict[str, Any], str]) -> None:
    _, rows, printed = check_result
    assert [p for p, row in rows.items() if row["verdict"] == "leak"] == [], printed


def test_canary_is_a_mismatch_because_random_weights_cannot_repeat_the_nonce(
    check_result: tuple[int, dict[str, Any], str],
) -> None:
    _, rows, printed = check_result
    assert (rows["canary"]["verdict"], rows["canary"]["reason"]) == ("mismatch", "nonce_missing"), printed


def test_the_gate_exits_1_on_the_mismatch(check_result: tuple[int, dict[str, Any], str]) -> None:
    code, _, printed = check_result
    assert code == EXIT_FAILED, printed
