"""``kvcanary blast-radius`` as a process: its report, and what bad input gets (exit codes, messages).

The incident is made by the incident rules in a migrated SQLite file; the command reads it as an
operator would, with a config naming a target that is down (no calibration to ask for).
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import yaml

from monitor.config.settings import IncidentConfig, RetentionConfig
from monitor.incidents import record_result
from monitor.storage.db import make_engine, make_session_factory, upgrade
from probes.base import ProbeResult, Verdict
from tests.conftest import REPO, free_port

NOW = datetime.now(UTC).replace(microsecond=0)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "monitor", "blast-radius", *args], capture_output=True, text=True, cwd=REPO,
        timeout=120,
    )  # fmt: skip


def setup(tmp_path: Path) -> tuple[Path, int]:
    url = f"sqlite:///{tmp_path / 'kvcanary.db'}"
    down = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: the calibration cannot be asked
    config = {
        "database_url": url,
        "targets": [{"name": "shared", "base_url": down, "engine": "reference", "model": "m",
                     "tenants": [{"name": "alice"}], "probes": ["canary", "capacity"]}],
    }  # fmt: skip
    path = tmp_path / "kvcanary.yml"
    path.write_text(yaml.safe_dump(config))
    upgrade(url)
    engine = make_engine(url)
    result = ProbeResult(
        Verdict.MISMATCH, "pool_below_context_window", "pool 1,024 < 8,192", {"pools": {"prefill": 1024}}
    )
    with make_session_factory(engine).begin() as s:
        opened = record_result(
            s, target_name="shared", engine="reference", base_url=down, model="m", probe="capacity",
            result=result, started_at=NOW - timedelta(hours=1), duration_seconds=0.1, policy=IncidentConfig(),
            retention=RetentionConfig(), now=NOW - timedelta(hours=1),
        )  # fmt: skip
    engine.dispose()
    return path, int(opened.incident_id or 0)


def test_the_report_says_unknown_without_a_source_and_names_what_limited_it(tmp_path: Path) -> None:
    config, incident = setup(tmp_path)
    text = run(str(incident), "--config", str(config))
    assert text.returncode == 0, text.stderr
    assert "Responses affected on shared: unknown" in text.stdout
    assert "did not count the sample text" in text.stderr  # the target is down: no calibration
    secret = "postgresql://kvc:hunter2-secret@127.0.0.1:1/litellm"
    answer = run(str(incident), "--config", str(config), "--json", "--litellm-db", secret,
                 "--logs", str(tmp_path / "none-*.jsonl"), "--chars-per-token", "1.0")  # fmt: skip
    assert answer.returncode == 0, answer.stderr
    radius = json.loads(answer.stdout)
    assert radius["affected_responses"] is None and radius["criterion"]["pool_tokens"] == 1024
    notes = {s["name"]: s["notes"] for s in radius["sources"]}
    assert notes["LiteLLM_SpendLogs"] == ['could not read "LiteLLM_SpendLogs": OperationalError']
    assert notes["gateway logs"] == ["a glob that matches no file"]
    assert "hunter2" not in answer.stdout + answer.stderr


def test_bad_input_exits_with_a_message_naming_it(tmp_path: Path) -> None:
    config, incident = setup(tmp_path)
    missing = run("999", "--config", str(config))
    assert missing.returncode == 1 and "no incident 999" in missing.stderr
    unwritable = run(str(incident), "--config", str(config), "--csv", str(tmp_path / "no" / "dir.csv"))
    assert unwritable.returncode == 2 and "blast-radius:" in unwritable.stderr
    assert run("0", "--config", str(config)).returncode == 2  # not an incident id
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump({"blast_radius": {"logs": [{"path": "/x", "format": "csv"}]}}))
    wrong = run(str(incident), "--config", str(bad))
    assert wrong.returncode == 2 and "blast_radius.logs[0].format" in wrong.stderr
