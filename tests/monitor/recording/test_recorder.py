"""Recording: any text a target returns is storable, and a verdict reaches the database or the spool.

On SQLite and on real PostgreSQL. The answers come from a scripted engine on a loopback server
(``tests/probes/probe_harness.py``): no real engine can be made to answer with these bytes on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Iterator
from datetime import timedelta

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from sqlalchemy import event, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.config.settings import Settings, parse_settings
from kvcanary.monitor.incidents import record_result
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.recording.pending import PendingResult
from kvcanary.monitor.recording.recorder import Recorder
from kvcanary.monitor.recording.spool import Spool
from kvcanary.monitor.recording.writer import BatchWriter
from kvcanary.monitor.runs.runner import ProbeRunner
from kvcanary.monitor.storage.db import make_engine, make_session_factory, upgrade
from kvcanary.monitor.storage.models import Incident, ProbeResultRow, Target
from kvcanary.monitor.storage.probe_states import save_state
from kvcanary.monitor.storage.storable import storable_text
from kvcanary.probes.base import ProbeResult, Verdict
from kvcanary.probes.markers import MarkerBook
from tests.probes.probe_harness import Call, FakeEngine
from tests.support.monitor_db import POLICY, RETENTION, T0

Factory = sessionmaker[Session]


@contextlib.contextmanager
def statements_of(session_factory: Factory) -> Iterator[list[str]]:
    """Collect the SQL statements sent through ``session_factory``'s engine meanwhile."""
    seen: list[str] = []
    engine = session_factory.kw["bind"]

    def note(conn: object, cursor: object, statement: str, *rest: object) -> None:
        seen.append(statement)

    event.listen(engine, "before_cursor_execute", note)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", note)


# The shapes that broke or could break a recording: the six characters of an escaped NUL (as text
# and as an escape the JSON parser turns into a real NUL), raw NUL, a lone surrogate, backslashes.
NASTY = ["\\u0000", "\x00", "\ud800", "\\\\u0000", "\\", '"', "\udfff\ud83d", "\u2028", "\\ud800"]
ANY_CHAR = st.characters(exclude_categories=())  # surrogates included
TEXT = st.one_of(st.text(ANY_CHAR, max_size=60), st.lists(st.sampled_from(NASTY), max_size=6).map("".join))


def settings_for(url: str = "http://engine.test") -> Settings:
    return parse_settings(
        {
            "targets": [
                {
                    "name": "glm",
                    "base_url": url,
                    "engine": "reference",
                    "model": "kvcanary-reference",
                    "tenants": [{"name": "alice"}, {"name": "bob"}],
                    "probes": ["canary"],
                }
            ]
        }
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    reason=TEXT,
    detail=TEXT,
    evidence=st.recursive(
        st.one_of(TEXT, st.integers(), st.floats(), st.none(), st.booleans()),
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
        max_leaves=12,
    ),
    verdict=st.sampled_from(list(Verdict)),
)
def test_any_text_a_probe_reports_is_stored_and_read_back(
    session_factory: Factory, reason: str, detail: str, evidence: object, verdict: Verdict
) -> None:
    result = ProbeResult(
        verdict, reason, detail, {"excerpt": evidence, detail: reason}, {"status_code": 10**12}
    )
    with session_factory() as s, s.begin():
        out = record_result(
            s, target_name="glm", engine="vllm", base_url="http://x", model="m", probe="canary",
            result=result, started_at=T0, duration_seconds=0.1, policy=POLICY, retention=RETENTION,
        )  # fmt: skip
    with session_factory() as s:
        row = s.get(ProbeResultRow, out.result_id)
        assert row is not None
        assert row.detail == storable_text(detail)[:2000]
        assert row.status_code is None  # a count no column can hold is dropped, not the row
        assert json.dumps(row.evidence)  # plain JSON, whatever came in
        assert "\x00" not in json.dumps(row.evidence, ensure_ascii=False)


def test_a_leaking_answer_full_of_escaped_nuls_is_recorded_with_its_incident(
    session_factory: Factory,
) -> None:
    """Main recorded 0 of 15 leaks when an answer held the text ``\\u0000``; every one must land."""
    previous: dict[str, str] = {}

    def leaky(call: Call) -> httpx.Response:
        # Each answer replays the previous request's prompt (another tenant's marker) in a stale page,
        # followed by JSON escapes that decode to the six characters \u0000, a real NUL and a lone
        # surrogate.
        stale, previous["prompt"] = previous.get("prompt", call.prompt), call.prompt
        content = json.dumps(stale)[:-1] + r' \\u0000 \u0000 \ud800 done"'
        chunk = '{"choices": [{"delta": {"content": ' + content + '}, "finish_reason": "stop"}]}'
        usage = {"choices": [], "usage": {"prompt_tokens": len(call.prompt), "completion_tokens": 9}}
        body = f"data: {chunk}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())

    engine = FakeEngine(reply=leaky)
    config = settings_for()
    spool = Spool(None)
    runner = ProbeRunner(
        config,
        {"glm": engine.target(("alice", "bob"))},
        MarkerBook(),
        MonitorMetrics(CollectorRegistry()),
        writer := BatchWriter(Recorder(config, session_factory, spool)),
    )

    async def runs() -> list[Verdict]:
        return [(await runner.run("glm", "canary"))[0].result.verdict for _ in range(5)]

    try:
        verdicts = asyncio.run(runs())
    finally:
        writer.close()
    assert verdicts == [Verdict.LEAK] * 5
    with session_factory() as s:
        leaks = s.scalars(select(ProbeResultRow).where(ProbeResultRow.verdict == "leak")).all()
        assert len(leaks) == 5 and len(spool) == 0
        assert all(r.evidence["leak_count"] >= 1 for r in leaks)
        incident = s.scalars(select(Incident)).one()
        assert (incident.severity, incident.state, incident.failure_count) == ("critical", "open", 5)


def test_a_result_that_cannot_be_stored_as_it_is_is_recorded_without_its_evidence(
    session_factory: Factory,
) -> None:
    """An unstorable value costs the evidence, never the verdict or its incident."""

    class Unstorable:
        def __str__(self) -> str:
            raise ValueError("no text for you")

    config = settings_for()
    recorder = Recorder(config, session_factory, Spool(None))
    result = ProbeResult(Verdict.LEAK, "foreign_marker", "seen", {"odd": Unstorable()})
    outcome = recorder.record(PendingResult.of(config.targets[0], "canary", result, T0, 0.2))
    assert outcome is not None and outcome.change == "opened"
    with session_factory() as s:
        row = s.get(ProbeResultRow, outcome.result_id)
        assert row is not None and row.verdict == "leak"
        assert set(row.evidence) == {"evidence_unstorable"}


def test_results_spooled_while_the_database_is_away_are_replayed_in_order(session_factory: Factory) -> None:
    """Point the recorder at a dead database, then give it the real one back."""
    from kvcanary.monitor.storage.db import make_engine, make_session_factory

    dead = make_session_factory(make_engine("postgresql+psycopg://postgres@127.0.0.1:1/none"))
    config = settings_for()
    spool = Spool(None)
    recorder = Recorder(config, dead, spool)
    target = config.targets[0]
    verdicts = ["leak", "pass", "mismatch", "pass", "pass", "pass"]
    for i, verdict in enumerate(verdicts):
        at = T0 + timedelta(seconds=i)
        assert (
            recorder.record(
                PendingResult.of(target, "canary", ProbeResult(Verdict(verdict), f"r{i}"), at, 0.1)
            )
            is None
        )
    assert len(spool) == len(verdicts)
    assert recorder.replay() == 0  # still dead: nothing lost, nothing done
    recorder.session_factory = session_factory
    assert recorder.replay() == len(verdicts)
    with session_factory() as s:
        reasons = s.scalars(select(ProbeResultRow.reason).order_by(ProbeResultRow.started_at)).all()
        assert reasons == [f"r{i}" for i in range(len(verdicts))]
        incident = s.scalars(select(Incident)).one()
        # Replayed in order: opened by the leak, a mismatch attached, resolved by the last 3 passes.
        assert (incident.severity, incident.state, incident.failure_count) == ("critical", "resolved", 2)
        assert s.scalar(select(func.count()).select_from(ProbeResultRow)) == len(verdicts)


def test_a_batch_of_results_follows_the_incident_rules_as_one_by_one(session_factory: Factory) -> None:
    """Group commit reads the open incidents once per batch; the rules must come out the same.

    Two pairs: one whose incident opened in an earlier batch and is resolved by this batch's passes,
    one that opens, takes passes and is resolved all within this batch.
    """
    config = settings_for()
    recorder = Recorder(config, session_factory, Spool(None))
    target = config.targets[0]

    def item(probe: str, verdict: str, second: int) -> PendingResult:
        at = T0 + timedelta(seconds=second)
        return PendingResult.of(target, probe, ProbeResult(Verdict(verdict), "r"), at, 0.1, at)

    first = recorder.record_many([item("canary", "mismatch", 0), item("canary", "pass", 1)])
    assert [o and o.change for o in first] == ["opened", None]
    batch = [item("canary", "pass", 2), item("boundary", "pass", 2), item("boundary", "leak", 3)]
    batch += [item(probe, "pass", 4 + i) for i in range(3) for probe in ("canary", "boundary")]
    outcomes = recorder.record_many(batch)
    changes = [(i.kind, o.change) for i, o in zip(batch, outcomes, strict=True) if o and o.change]
    assert changes == [("boundary", "opened"), ("canary", "resolved"), ("boundary", "resolved")]
    with session_factory() as s:
        states = {(i.probe, i.severity, i.state, i.consecutive_passes) for i in s.scalars(select(Incident))}
        assert states == {("canary", "high", "resolved", 3), ("boundary", "critical", "resolved", 3)}
        assert s.scalar(select(func.count()).select_from(ProbeResultRow)) == len(batch) + 2


def test_every_stored_probe_state_is_read_in_one_go_at_start(session_factory: Factory) -> None:
    """A restart preloads the states the probes left (one read, not one per pair), and a replica
    that takes a pair over forgets what it cached for it, to read what the other replica stored."""
    config = settings_for()
    recorder = Recorder(config, session_factory, Spool(None))
    target = config.targets[0]

    def item(probe: str, node: str, state: dict[str, object]) -> PendingResult:
        result = ProbeResult(Verdict.PASS, "r", state=state)
        return PendingResult.of(target, probe, result, T0, 0.1, T0, node)

    recorder.record_many([item("canary", "", {"n": 1}), item("counters", "decode-0", {"reads": [2, 3]})])
    with statements_of(session_factory) as seen:
        stored = recorder.load_states()
    assert len([sql for sql in seen if "probe_state" in sql]) == 1  # one read for every pair
    assert stored == {("glm", "canary", ""): {"n": 1}, ("glm", "counters", "decode-0"): {"reads": [2, 3]}}
    for (_, probe, node), state in stored.items():
        assert recorder.load_state("glm", probe, node) == state

    writer = BatchWriter(recorder)
    runner = ProbeRunner(config, {}, MarkerBook(), MonitorMetrics(CollectorRegistry()), writer)
    runner.preload_states(stored)
    assert asyncio.run(runner._state(("glm", "canary", ""))) == {"n": 1}
    with session_factory() as s, s.begin():  # another replica runs the pair and stores a newer state
        glm = s.scalar(select(Target.id).where(Target.name == "glm"))
        assert glm is not None
        save_state(s, target_id=glm, probe="canary", node="", state={"n": 2}, now=T0)
    assert asyncio.run(runner._state(("glm", "canary", ""))) == {"n": 1}  # cached
    runner.forget_states([("glm", "canary")])
    assert asyncio.run(runner._state(("glm", "canary", ""))) == {"n": 2}
    writer.close()


def test_configured_targets_get_their_rows_at_start_and_changes_are_written(session_factory: Factory) -> None:
    config = settings_for("http://engine.test/")
    recorder = Recorder(config, session_factory, Spool(None))
    recorder.ensure_targets(config.targets)
    with session_factory() as s:
        rows = s.execute(select(Target.id, Target.name, Target.base_url)).all()
    assert [tuple(r)[1:] for r in rows] == [("glm", "http://engine.test")]  # as public_url writes it
    # The cached id sends a first pass down the quiet path: the target table is not touched.
    target = config.targets[0]
    item = PendingResult.of(target, "canary", ProbeResult(Verdict.PASS, "r"), T0, 0.1, T0)
    with statements_of(session_factory) as seen:
        [outcome] = recorder.record_many([item])
    assert outcome is not None and outcome.change is None and outcome.target_id == rows[0].id
    assert not [sql for sql in seen if re.search(r"\b(FROM|INTO|UPDATE) target\b", sql)], seen

    moved = settings_for("http://engine-2.test")
    Recorder(moved, session_factory, Spool(None)).ensure_targets(moved.targets)
    with session_factory() as s:
        written = s.scalar(select(Target.updated_at))
    with statements_of(session_factory) as seen:
        Recorder(moved, session_factory, Spool(None)).ensure_targets(moved.targets)
    assert [sql.split()[0] for sql in seen if "target" in sql] == ["SELECT"]  # one read, no write
    with session_factory() as s:
        names = s.execute(select(Target.name, Target.base_url)).all()
        assert s.scalar(select(Target.updated_at)) == written
    assert [tuple(r) for r in names] == [("glm", "http://engine-2.test")]


def test_a_database_turned_read_only_in_a_failover_spools_verdicts_instead_of_dropping_them(
    scratch_url: str,
) -> None:
    """A demoted primary still answers, but every write fails with "read-only transaction" (an
    InternalError, SQLSTATE 25006): that says nothing about the row, so the leak must wait."""
    if not scratch_url.startswith("postgresql"):
        pytest.skip("read-only transactions are PostgreSQL's")
    upgrade(scratch_url)
    engine = make_engine(scratch_url)
    name = make_url(scratch_url).database

    def read_only(on: bool) -> None:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("SET default_transaction_read_only = off")  # this session may write
            setting = (
                "SET default_transaction_read_only = on" if on else "RESET default_transaction_read_only"
            )
            conn.exec_driver_sql(f'ALTER DATABASE "{name}" {setting}')
        engine.dispose()  # new connections take the setting

    recorder = Recorder(settings_for(), make_session_factory(engine), Spool(None))
    target = recorder.settings.targets[0]
    try:
        read_only(True)
        leak = ProbeResult(Verdict.LEAK, "foreign_marker", "a marker of alice reached bob")
        assert recorder.record(PendingResult.of(target, "cross_tenant", leak, T0, 1.0)) is None
        assert len(recorder.spool) == 1
        read_only(False)
        assert recorder.replay() == 1
    finally:
        read_only(False)
    with make_session_factory(engine)() as s:
        assert s.scalars(select(ProbeResultRow.verdict)).all() == ["leak"]
    engine.dispose()
