"""The deploy gate, ``kvcanary check``, against the SGLang engine itself (0.5.23, aggregated, CPU).

The installed console script runs as a subprocess, as an operator would run it, on a config written
here: one target with ``engine: sglang``, two tenants, five probes. What a correct engine on a
random-weight model must make each probe say:

- ``canary`` is a ``mismatch`` with reason ``nonce_missing``: the model cannot repeat a nonce. That
  it gets that far, not ``error``, shows that SGLang's answers and usage were read right.
- ``cross_tenant`` passes: every plant was answered and no answer holds the other tenant's marker.
- ``capacity`` passes with headroom: the pool (``--max-total-tokens``) is twice the window.
- ``version`` passes: 0.5.23 is past every SGLang entry in the defects file.
- ``counters`` is an ``error`` ``not_exposed``: SGLang exports no page-ownership counter, so the
  probe cannot judge isolation from its metrics, and says so rather than pass.
- Nothing is a ``leak``. The gate exits 1 (the mismatch), not 0, 2 or 3.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.sglang.server import SglangServer
from tests.support import REPO

pytestmark = pytest.mark.xdist_group("sglang")

PROBES = ["canary", "cross_tenant", "capacity", "version", "counters"]
EXIT_FAILED = 1
#: A request's limit: SGLang on this CPU, four streams at once on a loaded 2-core machine, took over
#: the default 30 s (the check said reads_unanswered); the test judges answers, not speed.
REQUEST_TIMEOUT_S = 120
CHECK_TIMEOUT_S = 540
CheckRun = tuple[int, dict[str, dict[str, Any]], str]


def write_config(folder: Path, server: SglangServer) -> Path:
    config = {
        "database_url": f"sqlite:///{folder / 'kvcanary.db'}",
        "api": {"listen": "127.0.0.1:0", "local_only": True},
        "targets": [
            {
                "name": "sglang-cpu",
                "base_url": server.url,
                "engine": "sglang",
                "model": server.model_name,
                "tenants": [{"name": "tenant-a"}, {"name": "tenant-b"}],
                "probes": PROBES,
                "timeout_seconds": REQUEST_TIMEOUT_S,
            }
        ],
    }
    path = folder / "kvcanary.yml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return path


@pytest.fixture(scope="session")
def check_run(sglang_server: SglangServer, tmp_path_factory: pytest.TempPathFactory) -> CheckRun:
    """Run the gate once: its exit code, its rows by probe, and everything it printed (for messages)."""
    config = write_config(tmp_path_factory.mktemp("check"), sglang_server)
    started = time.monotonic()
    done = subprocess.run(
        [str(Path(sys.executable).with_name("kvcanary")), "check", "--config", str(config), "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=CHECK_TIMEOUT_S, check=False,
    )  # fmt: skip
    printed = (
        f"exit {done.returncode} after {time.monotonic() - started:.1f} s\n"
        f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    )
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert all(row["target"] == "sglang-cpu" for row in rows), printed
    by_probe = {row["probe"]: row for row in rows}
    assert sorted(by_probe) == sorted(PROBES), printed
    return done.returncode, by_probe, printed


def verdict(run: CheckRun, probe: str) -> tuple[str, str]:
    row = run[1][probe]
    return row["verdict"], row["reason"]


def test_no_probe_reports_a_leak(check_run: CheckRun) -> None:
    _, rows, printed = check_run
    assert [probe for probe, row in rows.items() if row["verdict"] == "leak"] == [], printed


def test_canary_is_a_mismatch_because_random_weights_cannot_repeat_the_nonce(check_run: CheckRun) -> None:
    assert verdict(check_run, "canary") == ("mismatch", "nonce_missing"), check_run[2]


def test_cross_tenant_finds_no_foreign_marker_in_sglangs_answers(check_run: CheckRun) -> None:
    assert verdict(check_run, "cross_tenant") == ("pass", "no_foreign_marker"), check_run[2]


def test_capacity_passes_with_a_pool_twice_the_window(check_run: CheckRun) -> None:
    assert verdict(check_run, "capacity") == ("pass", "headroom_ok"), check_run[2]


def test_version_finds_no_known_defect_in_sglang_0_5_23(check_run: CheckRun) -> None:
    assert verdict(check_run, "version") == ("pass", "no_known_defect"), check_run[2]


def test_counters_say_isolation_cannot_be_judged_from_sglangs_metrics(check_run: CheckRun) -> None:
    assert verdict(check_run, "counters") == ("error", "not_exposed"), check_run[2]


def test_the_gate_exits_1_on_the_canarys_mismatch(check_run: CheckRun) -> None:
    code, _, printed = check_run
    assert code == EXIT_FAILED, printed
