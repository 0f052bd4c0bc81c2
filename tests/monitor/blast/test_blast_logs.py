"""Gateway log files read by DuckDB for a blast radius: every format, mixed files, broken files.

The scope is built by hand (a window, the over-pool criterion, the routed API bases), so each
test is the log reader alone against files written here, in each format's own shape.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb

from kvcanary.monitor.blast.logs import logs_requests, logs_tally
from kvcanary.monitor.blast.question import Bound, Criterion, Scope, Window

START = datetime(2026, 8, 27, 12, 0, tzinfo=UTC)
END = START + timedelta(hours=2)
BASE = "http://10.0.0.1:8000"
POOL = 1024


def scope(kind: str = "over_pool", cpt: float | None = 1.0) -> Scope:
    window = Window(Bound(START, "test"), Bound(END, "test"))
    criterion = Criterion(kind, "rule", pool_tokens=POOL if kind == "over_pool" else None)  # type: ignore[arg-type]
    return Scope("t", 1, "", window, criterion, (BASE,), cpt, frozenset({"f" * 64}))


def write_lines(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def sglang(rid: str, at: datetime, text: str, caller: str, **out: Any) -> dict[str, Any]:
    meta = {"id": rid, "prompt_tokens": 1, "finish_reason": {"type": "stop"}, **out}
    return {
        "timestamp": at.replace(tzinfo=None).isoformat(), "event": "request.finished", "rid": rid,
        "obj": {"rid": rid, "text": text, "received_time": at.timestamp(), "routing_key": caller},
        "out": {"text": "stale", "meta_info": meta},
    }  # fmt: skip


def test_sglang_request_logs_count_finished_over_pool_requests_and_say_what_they_cannot_size(
    tmp_path: Path,
) -> None:
    at = START + timedelta(minutes=5)
    lines = [
        sglang("a", at, "x" * 1500, "acme"),  # over the pool, reported 1: counted by its length
        sglang("b", at, "x" * 600, "acme"),  # under
        sglang("c", at, "x" * 2100, "globex"),  # cut by SGLang's log: sized by its count (1)
        sglang("d", at, "x" * 1800, "globex", finish_reason={"type": "abort", "status_code": 400}),
        {**sglang("e", at, "x" * 1600, "initech"), "event": "request.received"},
        sglang("f", START - timedelta(minutes=1), "x" * 1600, "initech"),  # before the window
    ]
    # No received_time and an offset: 14:10+02:00 is 12:10 UTC, inside the window.
    offset = sglang("g", at, "x" * 1700, "initech")
    del offset["obj"]["received_time"]
    offset["timestamp"] = "2026-08-27T14:10:00+02:00"
    write_lines(tmp_path / "sglang.log", [*lines, offset])
    tally = logs_tally([(str(tmp_path / "*.log"), "auto")], scope())
    assert {c: n.responses for c, n in tally.callers.items()} == {"acme": 1, "initech": 1}
    assert tally.covered and any("2,048 characters" in n for n in tally.notes)


def test_generic_openai_records_iso_and_epoch_times_statuses_and_routes(tmp_path: Path) -> None:
    at = START + timedelta(minutes=30)
    records = [
        {"id": "1", "time": at.timestamp(), "caller": "acme", "api_base": f"{BASE}/v1", "status": 200,
         "request": {"messages": [{"role": "user", "content": "y" * 2000}]}, "usage": {"prompt_tokens": 1}},
        {"id": "2", "time": at.strftime("%Y-%m-%dT%H:%M:%SZ"), "user": "globex", "api_base": BASE,
         "status": 200, "request": {"prompt": "y" * 3000}},
        {"id": "3", "time": at.replace(tzinfo=None).isoformat(), "caller": "globex", "status": 200,
         "request": {"messages": [{"role": "user", "content": [{"type": "text", "text": "z" * 1200}]}]}},
        {"id": "4", "time": at.timestamp(), "caller": "acme", "api_base": BASE, "status": 500,
         "request": {"prompt": "y" * 3000}},
        {"id": "5", "time": at.timestamp(), "caller": "acme", "api_base": "http://10.0.0.9:8000/v1",
         "status": 200, "request": {"prompt": "y" * 3000}},
        {"id": "6", "time": at.timestamp(), "caller": "acme", "key_hash": "f" * 64, "api_base": BASE,
         "status": 200, "request": {"prompt": "y" * 3000}},
    ]  # fmt: skip
    write_lines(tmp_path / "gw.jsonl", records)
    tally = logs_tally([(str(tmp_path / "gw.jsonl"), "openai")], scope())
    # 1: over by its length; 2: Z time, routed; 3: a naive ISO time is UTC, no api_base is the node's
    # own; 4: a 500; 5: another node's; 6: the monitor's own key.
    assert {c: n.responses for c, n in tally.callers.items()} == {"acme": 1, "globex": 2}
    assert {c: n.responses for c, n in tally.own.items()} == {"acme": 1}
    rows = logs_requests([(str(tmp_path / "gw.jsonl"), "openai")], scope(), limit=100)
    assert sorted(r[0] for r in rows) == ["1", "2", "3", "6"]


def litellm(i: int, caller: str, chars: int, **more: Any) -> dict[str, Any]:
    return {
        "id": f"c{i}", "startTime": (START + timedelta(minutes=i)).timestamp(), "status": "success",
        "api_base": f"{BASE}/v1", "prompt_tokens": 1,
        "metadata": {"user_api_key_team_id": caller, "user_api_key_hash": "a" * 64},
        "messages": [{"role": "user", "content": "w" * chars}], **more,
    }  # fmt: skip


def test_parquet_without_some_columns_mixed_globs_and_broken_files_are_read_or_named(tmp_path: Path) -> None:
    write_lines(tmp_path / "a.jsonl", [litellm(1, "acme", 1500), litellm(2, "acme", 500), "{not json"])
    write_lines(tmp_path / "b.jsonl", [litellm(3, "globex", 2500)])
    # A Parquet file with no `messages` and no `end_user`: sized by the reported count (1), with a note.
    thin = tmp_path / "thin.jsonl"
    write_lines(thin, [{k: v for k, v in litellm(4, "initech", 3000).items() if k != "messages"}])
    duckdb.sql(f"COPY (SELECT * FROM read_json('{thin}')) TO '{tmp_path}/c.parquet' (FORMAT parquet)")
    thin.unlink()
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "d.parquet").write_bytes(b"PAR1 this is not a parquet file")
    sources = [(str(tmp_path / "*.jsonl"), "auto"), (str(tmp_path / "*.parquet"), "auto"),
               (str(tmp_path / "a.jsonl"), "auto")]  # fmt: skip
    tally = logs_tally(sources, scope())
    assert {c: n.responses for c, n in tally.callers.items()} == {"acme": 1, "globex": 1}
    # Counted, never named: the page shows notes, and a path or an error's input is no one's business.
    assert "a file with no JSON record in its first lines" in tally.notes
    assert "a file not read (InvalidInputException)" in tally.notes
    assert not any(str(tmp_path) in n for n in tally.notes)
    assert any("1 line(s) were no log record" in n for n in tally.notes)
    assert "3 file(s)" in tally.detail  # a.jsonl named twice is read once


def test_a_log_the_reader_cannot_parse_as_its_given_format_is_a_note_not_a_crash(tmp_path: Path) -> None:
    (tmp_path / "x.parquet").write_bytes(b"not parquet at all")
    tally = logs_tally([(str(tmp_path / "x.parquet"), "litellm")], scope())
    assert not tally.covered and tally.notes == ["a file not read (InvalidInputException)"]
    nothing = logs_tally([(str(tmp_path / "none-*.jsonl"), "auto")], scope())
    assert not nothing.covered and nothing.notes == ["a glob that matches no file"]
    flagged = logs_tally([(str(tmp_path / "x.parquet"), "auto")], scope("flagged"))
    assert not flagged.covered and "no check's verdict" in flagged.notes[0]


def test_a_raw_key_in_a_log_never_becomes_a_callers_name_and_gzip_logs_are_read(tmp_path: Path) -> None:
    import gzip
    import hashlib

    raw = "kvc-custom-key-of-a-tenant"  # LiteLLM reports a key that is not an `sk-` key as it is
    digest = hashlib.sha256(raw.encode()).hexdigest()
    anonymous = litellm(5, "", 2000)
    anonymous["metadata"] = {"user_api_key_hash": raw}
    stranger = litellm(6, "", 2000)
    stranger["metadata"] = {"user_api_key_hash": "another-raw-key"}
    with gzip.open(tmp_path / "rotated.jsonl.gz", "wt") as out:
        out.write("\n".join(json.dumps(r) for r in (anonymous, stranger, litellm(7, "acme", 1600))) + "\n")
    base = scope()
    mine = Scope(base.target, 1, "", base.window, base.criterion, (BASE,), 1.0, frozenset({digest}))
    tally = logs_tally([(str(tmp_path / "*.gz"), "auto")], mine)
    other = hashlib.sha256(b"another-raw-key").hexdigest()
    assert {c: n.responses for c, n in tally.callers.items()} == {"acme": 1, other: 1}
    assert {c: n.responses for c, n in tally.own.items()} == {digest: 1}  # the tenant's, known by its digest
    names = [*tally.callers, *tally.own]
    assert raw not in names and "another-raw-key" not in names


def test_the_config_and_the_cli_name_exactly_the_formats_the_reader_maps() -> None:
    from typing import get_args

    from kvcanary.monitor.blast.log_formats import COLUMNS, NORMAL
    from kvcanary.monitor.commands.cli import LogFormat
    from kvcanary.monitor.config.settings import LogSourceConfig

    mapped = {"auto", *COLUMNS}
    assert set(COLUMNS) == set(NORMAL)
    assert set(get_args(LogSourceConfig.model_fields["format"].annotation)) == mapped
    assert {f.value for f in LogFormat} == mapped


def test_a_log_with_no_newline_is_told_in_bounded_memory_and_left_out_with_a_note(tmp_path: Path) -> None:
    """A file with no newline is never read whole to tell its format (a 2 GB one would take the
    monitor to 4.4 GB). Here 256 MB files, plain (sparse) and gzipped, with a prompt at their
    start: telling their formats must stay under +64 MB, and the note must quote nothing of them."""
    import gzip
    import os
    import tracemalloc

    from kvcanary.monitor.blast.logs import LONG_LINE

    size, start = 256 * 2**20, b'{"id": "x", "messages": [{"content": "SECRET-PROMPT '
    plain = tmp_path / "huge.jsonl"
    plain.write_bytes(start)
    os.truncate(plain, size)  # the rest reads as NUL bytes, and no newline anywhere
    with gzip.open(tmp_path / "huge.jsonl.gz", "wb", compresslevel=1) as out:
        out.write(start)
        for _ in range(size // 2**20):
            out.write(bytes(2**20))
    write_lines(tmp_path / "fine.jsonl", [litellm(1, "acme", 1500)])
    for fmt in ("auto", "litellm"):  # a format given is no licence to read a line whole either
        tracemalloc.start()
        try:
            tally = logs_tally([(str(tmp_path / "*.jsonl*"), fmt)], scope())
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MB to tell {fmt} files"
        assert {c: n.responses for c, n in tally.callers.items()} == {"acme": 1}  # the others still count
        assert f"{LONG_LINE} (2 times)" in tally.notes, tally.notes
        assert "16 MiB" in LONG_LINE
        shown = json.dumps([tally.notes, tally.detail])
        assert "SECRET" not in shown and "huge" not in shown
