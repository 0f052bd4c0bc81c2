"""The incident reproduced end to end, and its blast radius against the ground truth.

A real LiteLLM proxy (with the kvcanary tap, and a logger of its own standard logging payloads as
JSON lines, as its bucket loggers keep them) stands in front of the defective disaggregated
reference worker: a 1,024-token prefill pool under an 8,192-token window, over-pool prompts
answered 200 from stale pages. ``kvcanary serve`` probes the same worker; its capacity audit opens
the incident. Five callers send a known mix of prompt sizes with the ``openai`` SDK, streamed and
not, for two and a half minutes: three customers, a reporter the operator excludes, and the
monitor's own canary tenant (by its key). Then the worker is restarted fixed, the incident
resolves, and more over-1,024 prompts (which now fit) follow.

The blast radius must equal what the test computed itself (every over-pool request answered 200
in the window, per caller, none of the monitor's own, the reporter apart), from the traffic the
monitor recorded (REST), from the gateway's JSON log files (the CLI, with its CSV of request ids)
and from a ``LiteLLM_SpendLogs`` table made by LiteLLM's own migrations and filled from the same
payloads as LiteLLM fills it.
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from openai import APIStatusError

from tests.litellm.test_tap_litellm import (
    WORDS,
    ask,
    assert_no_customer_text,
    client_of,
    tap_env,
    with_ingest_token,
)
from tests.monitor.served import Served, reference_target
from tests.support import REPO, WorkerProcess
from tests.support.litellm import CALLERS, TAP_CALLBACK, Proxy

DEFECTIVE = (
    "--mode", "disaggregated", "--admission", "placeholder", "--prefill-pool-tokens", "1024",
    "--decode-pool-tokens", "8192", "--context-window", "8192", "--page-size", "16",
)  # fmt: skip
FIXED = (
    "--mode", "disaggregated", "--admission", "reject", "--prefill-pool-tokens", "16384",
    "--decode-pool-tokens", "16384", "--context-window", "8192", "--page-size", "16",
)  # fmt: skip
POOL = 1024
#: Prompt sizes in characters (one byte, one token here): two under the pool, two well over it.
SIZES = (300, 650, 1500, 2400)
OWN_KEY = "sk-kvcanary-canary-alice-0001"  # the monitor's tenant alice: its requests are excluded
REPORTER = "sk-reporter-0004"
GATEWAY_CALLERS = {
    **CALLERS,
    REPORTER: ("reporter", "reporter-key"),
    OWN_KEY: ("kvcanary-canary", "kvcanary-alice"),
}

GATEWAY_LOG = '''
import json
import os

from litellm.integrations.custom_logger import CustomLogger


class JsonLines(CustomLogger):
    """LiteLLM's standard logging payload, one per line: what its bucket loggers keep."""

    def _write(self, kwargs):
        payload = kwargs.get("standard_logging_object")
        if payload:
            with open(os.environ["KVCANARY_TEST_GATEWAY_LOG"], "a", encoding="utf-8") as out:
                out.write(json.dumps(payload, default=str) + "\\n")

    async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):
        self._write(kwargs)

    async def async_log_failure_event(self, kwargs, response_obj, start_time, end_time):
        self._write(kwargs)


logger = JsonLines()
'''


@dataclass
class Sent:
    caller: str
    chars: int
    status: int
    at: float

    @property
    def over(self) -> bool:
        return self.chars > POOL and self.status == 200


def prompt(rng: random.Random, caller: str, chars: int) -> str:
    words = f"{caller} writes: " + " ".join(rng.choice(WORDS) for _ in range(chars // 4))
    return (words * 2)[:chars]


def send_round(
    proxy: Proxy, rng: random.Random, n: int, sentences: list[str], spread_over: float = 0.0
) -> list[Sent]:
    """Send ``n`` requests, the callers in turn, paced to last about ``spread_over`` seconds."""
    sent = []
    keys = list(GATEWAY_CALLERS)
    begin = time.monotonic()
    for i in range(n):
        time.sleep(max(0.0, begin + spread_over * i / n - time.monotonic()))
        key = keys[i % len(keys)]
        caller, chars = GATEWAY_CALLERS[key][0], rng.choice(SIZES)
        text = prompt(rng, caller, chars)
        sentences.append(text)
        at = time.time()
        try:
            ask(
                client_of(proxy, key),
                "shop",
                [{"role": "user", "content": text}],
                stream=i % 3 == 0,
                max_tokens=24,
            )
            status = 200
        except APIStatusError as exc:
            status = exc.status_code
        sent.append(Sent(caller, chars, status, at))
    return sent


def spend_log_row(payload: dict[str, Any]) -> dict[str, Any]:
    """The ``LiteLLM_SpendLogs`` row LiteLLM writes for a logging payload (its
    ``get_logging_payload``), with ``store_prompts_in_spend_logs: true``."""
    meta = payload.get("metadata") or {}
    at = datetime.fromtimestamp(payload["startTime"], UTC).replace(tzinfo=None)
    end = datetime.fromtimestamp(payload["endTime"], UTC).replace(tzinfo=None)
    return {
        "request_id": payload["id"],
        "call_type": payload.get("call_type") or "",
        "api_key": meta.get("user_api_key_hash") or "",
        "spend": 0.0,
        "total_tokens": payload.get("total_tokens") or 0,
        "prompt_tokens": payload.get("prompt_tokens") or 0,
        "completion_tokens": payload.get("completion_tokens") or 0,
        "startTime": at,
        "endTime": end,
        "model": payload.get("model") or "",
        "model_group": payload.get("model_group") or "",
        "api_base": payload.get("api_base") or "",
        "user": meta.get("user_api_key_user_id") or "",
        "team_id": meta.get("user_api_key_team_id") or "",
        "end_user": payload.get("end_user") or "",
        "status": payload.get("status") or "success",
        "metadata": json.dumps({"user_api_key_alias": meta.get("user_api_key_alias")}),
        "proxy_server_request": json.dumps(
            {"model": payload.get("model_group"), "messages": payload.get("messages")}
        ),
        "litellm_call_id": payload.get("litellm_call_id"),
    }


def fill_spend_logs(url: str, payloads: list[dict[str, Any]]) -> None:
    rows = [spend_log_row(p) for p in payloads]
    columns = list(rows[0])
    quoted = ", ".join(f'"{c}"' for c in columns)
    marks = ", ".join(f"%({c})s" for c in columns)
    with psycopg.connect(url) as conn:
        conn.cursor().executemany(f'INSERT INTO "LiteLLM_SpendLogs" ({quoted}) VALUES ({marks})', rows)


def kvcanary(monitor: Served, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "monitor", *args, "--config", str(monitor.config_path)],
        capture_output=True, text=True, cwd=REPO, env=monitor.env, timeout=180,
    )  # fmt: skip


def by_caller(radius: dict[str, Any]) -> dict[str, int]:
    return {c["caller"]: c["responses"] for c in radius["callers"]}


@pytest.mark.external_service
def test_the_incident_reproduced_through_litellm_has_the_blast_radius_the_test_counted(
    tmp_path: Path,
    start_worker: Callable[..., WorkerProcess],
    served: Callable[..., Served],
    litellm_proxy: Callable[..., Proxy],
    litellm_db: str,
) -> None:
    worker = start_worker(*DEFECTIVE)
    target = reference_target(
        "shared",
        worker.url,
        probes=["canary", "capacity"],
        interval_seconds=1.0,
        probe_intervals={"capacity": 1.0},
    )
    config = {
        "targets": [target],
        "traffic": {"pass_interval_seconds": 1},
        "incidents": {"resolve_after_passes": 2},
        # The page leaves the reporter out, as the API and the CLI are asked to.
        "blast_radius": {"exclude_callers": ["reporter"]},
    }
    monitor = with_ingest_token(served(config))
    monitor.env["KVC_KEY_ALICE"] = OWN_KEY
    monitor.start()
    incident = monitor.wait_for(
        "the capacity audit opens the incident",
        lambda: next(
            iter(monitor.get("/api/v1/incidents", probe="capacity", state="open").json()["items"]), None
        ),
    )
    gateway_log = tmp_path / "gateway" / "litellm.jsonl"
    gateway_log.parent.mkdir()
    env = {**tap_env(monitor), "KVCANARY_TEST_GATEWAY_LOG": str(gateway_log)}
    proxy = litellm_proxy({"shop": worker.url}, env, callback=[TAP_CALLBACK, "gateway_log.logger"],
                          callers=GATEWAY_CALLERS, files={"gateway_log.py": GATEWAY_LOG})  # fmt: skip
    rng = random.Random(19)
    sentences: list[str] = []
    leaking = send_round(proxy, rng, 120, sentences, spread_over=150.0)  # a few minutes, across minute edges
    assert sum(s.over for s in leaking) >= 25, leaking  # the defect answered over-pool prompts 200

    worker.stop()
    start_worker(*FIXED, port=worker.port)
    monitor.wait_for(
        "the fixed worker resolves the incident",
        lambda: monitor.get(f"/api/v1/incidents/{incident['id']}").json()["state"] == "resolved",
        timeout=60,
    )
    after = send_round(proxy, rng, 10, sentences)  # over 1,024 now fits: answered 200, after the window
    assert any(s.over for s in after)

    truth = Counter(s.caller for s in leaking if s.over and s.caller not in ("kvcanary-canary", "reporter"))
    own = sum(1 for s in leaking if s.over and s.caller == "kvcanary-canary")
    reporter = sum(1 for s in leaking if s.over and s.caller == "reporter")
    sent = len(leaking) + len(after)
    monitor.wait_for("every payload logged", lambda: len(gateway_log.read_text().splitlines()) >= sent)
    path = f"/api/v1/incidents/{incident['id']}/blast-radius"

    def recorded() -> dict[str, Any] | None:
        radius = monitor.get(path, exclude="reporter").json()
        return radius if by_caller(radius) == dict(truth) else None

    radius = monitor.wait_for("the tap's records counted", recorded, timeout=30)
    assert radius["affected_responses"] == sum(truth.values())
    # The node was below its window from its first reading: the leak may have begun before it, so
    # the window opens when the monitor first saw the target.
    assert "no capacity reading of" in radius["window"]["start_how"]
    assert radius["window"]["start_how"].endswith("since the monitor first saw the target")
    assert radius["window"]["end_how"].startswith("resolved")
    excluded = {e["caller"]: e["responses"] for e in radius["excluded"]}
    assert excluded == {"kvcanary-canary": own, "reporter": reporter} and own > 0 and reporter > 0

    logs = str(gateway_log.parent / "*.jsonl")
    logged = kvcanary(monitor, "blast-radius", str(incident["id"]), "--logs", logs,
                      "--exclude", "reporter", "--json", "--csv", str(tmp_path / "notify.csv"))  # fmt: skip
    assert logged.returncode == 0, logged.stderr
    from_logs = json.loads(logged.stdout)
    assert [s["name"] for s in from_logs["sources"] if s["primary"]] == ["gateway logs"]
    assert by_caller(from_logs) == dict(truth)
    assert {e["caller"]: e["responses"] for e in from_logs["excluded"]} == excluded
    notify = (tmp_path / "notify.csv").read_text().splitlines()
    assert len(notify) == 1 + sum(truth.values()) and notify[0].startswith("request_id,caller,started_at")

    fill_spend_logs(litellm_db, [json.loads(line) for line in gateway_log.read_text().splitlines()])
    spent = kvcanary(monitor, "blast-radius", str(incident["id"]), "--litellm-db", litellm_db, "--exclude",
                     "reporter", "--json", "--csv", str(tmp_path / "spend.csv"))  # fmt: skip
    assert spent.returncode == 0, spent.stderr
    from_spend = json.loads(spent.stdout)
    assert [s["name"] for s in from_spend["sources"] if s["primary"]] == ["LiteLLM_SpendLogs"]
    assert by_caller(from_spend) == dict(truth)

    # The same requests and callers (LiteLLM keeps times to the millisecond: the third column differs).
    def ids(lines: list[str]) -> list[tuple[str, ...]]:
        return sorted(tuple(line.split(",")[:2]) for line in lines[1:])

    assert ids((tmp_path / "spend.csv").read_text().splitlines()) == ids(notify)

    text = kvcanary(monitor, "blast-radius", str(incident["id"]), "--exclude", "reporter")
    assert text.returncode == 0 and f"Responses affected on shared: {sum(truth.values())}" in text.stdout
    page = monitor.get(f"/incidents/{incident['id']}").text
    assert f"<b>{sum(truth.values())}</b>" in page and "Disclosure summary" in page
    assert_no_customer_text(monitor, sentences)


def test_the_spend_log_counts_with_no_caller_excluded_and_never_names_a_raw_key(litellm_db: str) -> None:
    """LiteLLM's own table, made by its migrations: the default case (nobody excluded) counts, and
    a key LiteLLM kept raw is counted under its digest."""
    from datetime import timedelta

    from kvcanary.monitor.blast.question import Bound, Criterion, Scope, Window
    from kvcanary.monitor.blast.spendlogs import spendlogs_tally

    start = datetime(2026, 8, 27, 12, 0, tzinfo=UTC)
    base = "http://10.0.0.1:8000"

    def payload(i: int, team: str, key: str, chars: int) -> dict[str, Any]:
        at = (start + timedelta(minutes=i)).timestamp()
        return {"id": f"chatcmpl-{i}", "call_type": "acompletion", "startTime": at, "endTime": at + 1,
                "status": "success", "api_base": f"{base}/v1", "prompt_tokens": 1, "model_group": "shop",
                "metadata": {"user_api_key_team_id": team, "user_api_key_hash": key},
                "messages": [{"role": "user", "content": "w" * chars}]}  # fmt: skip

    rows = [payload(1, "acme", "a" * 64, 1500), payload(2, "acme", "a" * 64, 500),
            payload(3, "", "raw-custom-key", 3000), payload(4, "globex", "b" * 64, 2000)]  # fmt: skip
    fill_spend_logs(litellm_db, rows)
    window = Window(Bound(start, "test"), Bound(start + timedelta(hours=1), "test"))
    scope = Scope("t", 1, "", window, Criterion("over_pool", "rule", pool_tokens=1024), (base,), 1.0)
    tally = spendlogs_tally(litellm_db, scope)
    assert tally.covered, tally.notes
    raw = hashlib.sha256(b"raw-custom-key").hexdigest()
    assert {c: n.responses for c, n in tally.callers.items()} == {"acme": 1, "globex": 1, raw: 1}
    assert sum(tally.buckets.values()) == 3
