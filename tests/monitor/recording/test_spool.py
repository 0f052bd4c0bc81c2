"""The spool: bounded, ordered, on disk, and never the place where a leak is dropped for a pass."""

from __future__ import annotations

import stat
from datetime import UTC, datetime
from pathlib import Path

import pytest

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.recording.pending import PendingResult
from kvcanary.monitor.recording.spool import Spool, SpoolBusy
from kvcanary.probes.base import ProbeResult, Verdict

TARGET = TargetConfig(name="glm", base_url="http://127.0.0.1:1", tenants=[{"name": "a"}, {"name": "b"}])
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def pending(verdict: str, n: int = 0) -> PendingResult:
    result = ProbeResult(Verdict(verdict), f"r{n}", f"detail {n}", {"n": n}, {"latency_seconds": 0.1})
    return PendingResult.of(TARGET, "canary", result, NOW, 0.1, NOW)


def drain(spool: Spool) -> list[tuple[str, str]]:
    out = []
    while (item := spool.head()) is not None:
        out.append((item.result.verdict, item.result.reason))
        spool.remove(item)
    return out


def test_entries_come_back_oldest_first_and_survive_a_restart(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", max_entries=100)
    for i, verdict in enumerate(["pass", "leak", "error", "mismatch"]):
        spool.append(pending(verdict, i))
    spool.close()
    reopened = Spool(tmp_path / "spool", max_entries=100)
    assert drain(reopened) == [("pass", "r0"), ("leak", "r1"), ("error", "r2"), ("mismatch", "r3")]
    assert not list((tmp_path / "spool").glob("*.json"))
    reopened.append(pending("pass", 9))
    assert reopened.head().seq > 4  # type: ignore[union-attr]  # numbering never goes back


def test_the_folder_and_its_files_are_private(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", max_entries=10)
    spool.append(pending("leak"))
    assert stat.S_IMODE((tmp_path / "spool").stat().st_mode) == 0o700
    (entry,) = (tmp_path / "spool").glob("*.json")
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600


def test_a_full_spool_gives_way_by_verdict_pass_error_mismatch_and_counts_every_drop(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", max_entries=3)
    spool.append(pending("pass", 0))
    spool.append(pending("error", 1))
    spool.append(pending("pass", 2))
    assert spool.append(pending("leak", 3))  # displaces the oldest pass
    assert spool.append(pending("mismatch", 4))  # then the other pass
    assert spool.append(pending("leak", 5))  # then the error
    assert not spool.append(pending("pass", 6))  # nothing lesser left: the pass itself goes
    assert spool.append(pending("leak", 7))  # a mismatch yields to a leak
    assert not spool.append(pending("leak", 8))  # full of leaks: dropped, and counted, not hidden
    assert drain(spool) == [("leak", "r3"), ("leak", "r5"), ("leak", "r7")]
    assert dict(spool.dropped) == {"pass": 3, "error": 1, "mismatch": 1, "leak": 1}


def test_a_second_process_cannot_share_a_spool_folder(tmp_path: Path) -> None:
    first = Spool(tmp_path / "spool")
    with pytest.raises(SpoolBusy):
        Spool(tmp_path / "spool")
    first.close()
    Spool(tmp_path / "spool").close()


def damaged(**fields: object) -> str:
    """A spooled entry with ``fields`` replaced (None: left out), as JSON."""
    import json

    entry = {**pending("leak", 1).stored(), "seq": 1, **fields}
    return json.dumps({k: v for k, v in entry.items() if v is not None})


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        damaged(reason=None),
        damaged(verdict="maybe"),
        damaged(started_at="yesterday"),
        damaged(attempted_at=None),
        damaged(source="gossip"),
        damaged(colour="red"),
    ],
    ids=[
        "not-json",
        "no-reason",
        "no-such-verdict",
        "not-a-time",
        "no-attempt",
        "no-such-source",
        "unknown-field",
    ],
)
def test_a_damaged_entry_is_set_aside_and_the_rest_replayed(tmp_path: Path, text: str) -> None:
    spool = Spool(tmp_path / "spool")
    spool.append(pending("leak", 1))
    spool.append(pending("leak", 2))
    spool.close()
    first = sorted((tmp_path / "spool").glob("*.json"))[0]
    first.write_text(text)
    reopened = Spool(tmp_path / "spool")
    assert drain(reopened) == [("leak", "r2")]
    assert first.with_suffix(".json.bad").exists()


def test_an_entry_round_trips_everything_the_database_needs(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    spool.append(pending("mismatch", 7))
    spool.close()
    item = Spool(tmp_path / "spool").head()
    assert item is not None
    result = item.result
    assert (item.target, item.engine, item.base_url, item.model) == (
        "glm",
        "reference",
        "http://127.0.0.1:1",
        "default",
    )
    assert (result.verdict, result.reason, result.evidence, result.measurements) == (
        Verdict.MISMATCH,
        "r7",
        {"n": 7},
        {"latency_seconds": 0.1},
    )
    assert item.started_at == NOW


def test_in_memory_spools_are_bounded_the_same_way() -> None:
    spool = Spool(None, max_entries=10)
    for i in range(10):
        spool.append(pending("pass", i))
    assert spool.append(pending("leak", 99))
    assert len(spool) == 10 and spool.dropped["pass"] == 1 and spool.where == "memory"


def test_an_entry_spooled_by_the_previous_release_naming_its_kind_probe_is_replayed(tmp_path: Path) -> None:
    import json

    folder = tmp_path / "spool"
    folder.mkdir(mode=0o700)
    old = pending("leak", 7).stored()
    old["probe"] = old.pop("kind")  # 0.1.0 wrote the kind under "probe"
    old["seq"] = 1
    (folder / f"{1:016d}.json").write_text(json.dumps(old))
    entry = Spool(folder).head()
    assert entry is not None and (entry.kind, entry.result.verdict, entry.result.reason) == (
        "canary",
        "leak",
        "r7",
    )
