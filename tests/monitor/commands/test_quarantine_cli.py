"""``kvcanary quarantine list|put|lift`` as a process, on a migrated SQLite file whose leak incident
the rules quarantined: what it prints, what it changes, and the exit codes of bad input."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import yaml

from kvcanary.monitor.config.settings import IncidentConfig, RetentionConfig, load_settings
from kvcanary.monitor.containment.rules import QuarantineRules
from kvcanary.monitor.incidents import record_result
from kvcanary.monitor.storage.db import make_engine, make_session_factory, upgrade
from kvcanary.probes.base import ProbeResult, Verdict
from tests.support import REPO
from tests.support.pace import PROCESS_SECONDS

NOW = datetime.now(UTC)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "monitor", "quarantine", *args], capture_output=True, text=True, cwd=REPO,
        timeout=PROCESS_SECONDS,
    )  # fmt: skip


def setup(tmp_path: Path, mode: str = "quarantine") -> Path:
    """A config and database where target ``glm`` leaked and the rules quarantined it."""
    url = f"sqlite:///{tmp_path / 'kvcanary.db'}"
    tenants = [{"name": "a"}, {"name": "b"}]
    config = {
        "database_url": url,
        "containment": {"mode": mode},
        "targets": [
            {"name": "glm", "base_url": "http://127.0.0.1:1", "tenants": tenants, "probes": ["canary"]},
            {"name": "calm", "base_url": "http://127.0.0.1:2", "tenants": tenants, "probes": ["canary"]},
        ],
    }
    path = tmp_path / "kvcanary.yml"
    path.write_text(yaml.safe_dump(config))
    upgrade(url)
    engine = make_engine(url)
    leak = ProbeResult(Verdict.LEAK, "foreign_marker", "another tenant's marker", {"leak_count": 1})
    with make_session_factory(engine).begin() as s:
        for name, result in (("glm", leak), ("calm", ProbeResult(Verdict.PASS, "ok"))):
            record_result(
                s, target_name=name, engine="reference", base_url="http://127.0.0.1:1", model="m",
                probe="canary", result=result, started_at=NOW - timedelta(seconds=5), duration_seconds=0.1,
                policy=IncidentConfig(), retention=RetentionConfig(), now=NOW - timedelta(seconds=4),
            )  # fmt: skip
    settings = load_settings(path)
    QuarantineRules(make_session_factory(engine), lambda: settings).sync()
    engine.dispose()
    return path


def test_list_put_and_lift_change_what_the_gateways_read(tmp_path: Path) -> None:
    config = str(setup(tmp_path))
    listed = run("list", "--config", config)
    assert listed.returncode == 0, listed.stderr
    (line,) = listed.stdout.splitlines()
    assert line.startswith("glm\tquarantined\tincident incident ")

    put = run("put", "calm", "--reason", "draining for an upgrade", "--config", config)
    assert put.returncode == 0 and put.stdout.startswith("calm\tquarantined\toperator"), put.stderr
    lifted = run("lift", "glm", "--reason", "verified false alarm", "--config", config)
    assert lifted.returncode == 0 and "verified false alarm" in lifted.stdout, lifted.stderr
    assert [row.split("\t")[0] for row in run("list", "--config", config).stdout.splitlines()] == ["calm"]


def test_observe_lists_observed_and_bad_input_gets_a_clear_exit(tmp_path: Path) -> None:
    config = str(setup(tmp_path, mode="observe"))
    assert run("list", "--config", config).stdout.startswith("glm\tobserved\tincident")
    nothing = run("lift", "calm", "--config", config)
    assert nothing.returncode == 1 and "calm is not quarantined" in nothing.stderr
    unknown = run("put", "nope", "--reason", "typo", "--config", config)
    assert unknown.returncode == 1 and "no target named nope" in unknown.stderr
    no_reason = run("put", "calm", "--config", config)
    assert no_reason.returncode == 2 and "--reason" in no_reason.stderr
    missing = run("list", "--config", str(tmp_path / "absent.yml"))
    assert missing.returncode == 2 and "absent.yml" in missing.stderr
