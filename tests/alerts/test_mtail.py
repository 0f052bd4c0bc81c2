"""``alerts/mtail/sglang_kv_canary.mtail``: SGLang's own KV canary, read by a real mtail and judged by
the counters probe, case by case.

The canary running in the real engine is ``tests/sglang/test_kv_canary_on_sglang.py`` (opt-in: SGLang
on this CPU, a read violation provoked by SGLang's own fault injection). The cases it cannot provoke
are here: a write-only violation, raise mode's record at the end of a traceback, the labels of releases
before 0.5.23, a ring that overflowed before every violation was logged, a log page gone. The log is
written line for line as 0.5.23 writes it (``srt/kv_canary/runner/violation_reporter.py`` and
``stats_logger.py``, behind the logger's ``[time DPn TPn]`` prefix; the real engine's lines match
them), and the node's own page is the SGLang stub serving the 0.5.23 prefill page. mtail (Debian's
3.0.0~rc50) tails the log for real, and the probe reads both pages over HTTP as it reads any node.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes.base import ProbeResult, Verdict
from kvcanary.probes.markers import MarkerBook
from tests.alerts import require_tool
from tests.support import free_port, stop_process
from tests.support.mtail import PROGRAMS, Mtail, running_mtail
from tests.support.sglang_stub import SGLangStub, start_sglang_stub

PREFIX = "[2026-12-05 10:00:00 DP0 TP0] "


class LoggedMtail(Mtail):
    def write(self, *messages: str) -> None:
        """Append log records as SGLang's logger writes them: the prefix on a record's first line."""
        with self.log.open("a") as out:
            out.writelines(PREFIX + message + "\n" for message in messages)


@pytest.fixture
def mtail(tmp_path: Path) -> Iterator[LoggedMtail]:
    log = tmp_path / "sglang.log"
    log.touch()
    with running_mtail(log, tmp_path) as running:
        yield LoggedMtail(running.url, running.log, running.proc)


@pytest.fixture
def sglang() -> Iterator[SGLangStub]:
    stub = start_sglang_stub("sglang-0.5.22-prefill-fixed.json", metrics="sglang-0.5.23-metrics-prefill.txt")
    yield stub
    stub.stop()


# --- SGLang's lines (0.5.23's format strings, filled in) ------------------------------------------------


def stats(step: int, violations: int) -> str:
    return (
        f"[canary] step={step} protected_tokens={40 * step} sweep_passes={step // 100} "
        f"violations={violations} launch_tags_active=6/12"
    )


def violation(tag: str, reasons: list[str], total: int, *, raised: bool = False) -> str:
    """One violation record: seven lines, the structured one first (a verify failure's body)."""
    structured = (
        f"kv_canary violation: launch_tag={tag} fail_reason={'+'.join(reasons)} slot_idx=812 position=17 "
        "stored_token=1034 expected_token=1034 stored_chain_hash=0x00000000deadbeef "
        "expected_aux=0x0000000012345678"
    )
    lines = [
        ("RuntimeError: " if raised else "") + structured,
        f"KV cache canary violation detected (kernel_kind={tag}, slot_idx=812, position=17)",
        f"canary_kind:       per_forward_{tag.lower()}",
        f"  fail_reasons: {' '.join(reasons)}",
        "  stored:   token_id=1034   position=17 prev_hash=0x00000000deadbeef",
        "  expected: prev_hash=0x0000000012345678",
        f"  total_violations={total} ring_overflow=False step_when_pumped=130",
    ]
    return "\n".join(lines)


# --- the probe on both pages ------------------------------------------------------------------------------


def read(sglang: SGLangStub, log_url: str | None, state: dict[str, Any] | None = None) -> ProbeResult:
    """Run ``counters`` once on the SGLang node, with its log page at ``log_url`` (None: none)."""
    node = {"name": "prefill-0", "role": "prefill", "info_url": sglang.url, "log_metrics_url": log_url}
    config = TargetConfig(
        name="sglang-pd",
        base_url=sglang.url,
        engine="sglang",
        tenants=[{"name": "alice"}],
        probes=["counters"],
        nodes=[node],
    )

    async def go() -> ProbeResult:
        async with OpenAIHttpTarget(config, {"alice": "sk-alice"}) as target:
            node = target.nodes[0]
            return (await execute_probe("counters", target, MarkerBook(), config, node=node, state=state))[0]

    return asyncio.run(go())


def first_read(sglang: SGLangStub, mtail: LoggedMtail) -> ProbeResult:
    """The canary's first stats line logged and read by mtail, then the node's first read."""
    mtail.write(stats(100, 0))
    mtail.until("sglang_kv_canary_step", 100)
    return read(sglang, mtail.url)


def read_after(
    sglang: SGLangStub, mtail: LoggedMtail, before: ProbeResult, record: str, counted: str
) -> ProbeResult:
    """Log ``record``, wait until mtail has counted it in ``counted`` (one more), and read again."""
    was = mtail.samples()[counted]
    mtail.write(record)
    mtail.until(counted, was + 1)
    return read(sglang, mtail.url, before.state)


def series(result: ProbeResult, counter: str) -> dict[str, Any]:
    return next(s for s in result.evidence["series"] if s["counter"] == counter)


def test_the_program_compiles_in_mtail() -> None:
    binary = require_tool("mtail", "mtail")
    done = subprocess.run(
        [binary, "--compile_only", "--progs", str(PROGRAMS), "--logtostderr", "--port", str(free_port()),
         "--address", "127.0.0.1"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_quiet_canary_passes_with_both_counters_read_at_zero(
    mtail: LoggedMtail, sglang: SGLangStub
) -> None:
    result = first_read(sglang, mtail)
    assert (result.verdict, result.reason) == (Verdict.PASS, "counters_clean"), result.detail
    assert series(result, "engine_canary_violations")["after"] == 0
    assert series(result, "engine_canary_write_violations")["after"] == 0
    # The engine's own page still counts as the engine's: its retries came from it, not from mtail.
    assert series(result, "prefill_retries")["after"] == 3
    assert result.evidence["log_metrics"] == {"url": mtail.url, "read": True}
    engine_total = next(g for g in result.evidence["gauges"] if g["gauge"] == "kv_canary_engine_violations")
    assert (engine_total["value"], engine_total["off"]) == (0, {})


def test_a_slot_a_request_read_failing_its_canary_is_a_leak_of_the_node(
    mtail: LoggedMtail, sglang: SGLangStub
) -> None:
    first = first_read(sglang, mtail)
    mtail.write(violation("TAIL_K_FULL", ["verify_chain_hash", "verify_position"], 1), stats(200, 3))
    mtail.until("sglang_kv_canary_verify_violations_total", 1)
    mtail.until("sglang_kv_canary_engine_violations", 3)
    second = read(sglang, mtail.url, first.state)
    assert (second.verdict, second.reason) == (Verdict.LEAK, "engine_canary_violations_increased")
    assert "prefill-0" in second.detail
    found = series(second, "engine_canary_violations")
    assert (found["before"], found["after"], found["increase"]) == (0, 1, 1)
    # The engine counted three (its ring overflowed before two were logged): said, not judged twice.
    engine_total = next(g for g in second.evidence["gauges"] if g["gauge"] == "kv_canary_engine_violations")
    assert engine_total["value"] == 3 and engine_total["off"]
    by_tag = mtail.samples()
    key = 'sglang_kv_canary_violations_by_tag_total{fail_reason="verify_chain_hash+verify_position",'
    assert by_tag[key + 'launch_tag="TAIL_K_FULL",prog="sglang_kv_canary.mtail"}'] == 1


def test_a_write_only_violation_is_a_mismatch_and_older_labels_still_count_as_reads(
    mtail: LoggedMtail, sglang: SGLangStub
) -> None:
    first = first_read(sglang, mtail)
    record = violation("HEAD_V_FULL", ["write_token", "write_position"], 1)
    second = read_after(sglang, mtail, first, record, "sglang_kv_canary_write_violations_total")
    assert (second.verdict, second.reason) == (Verdict.MISMATCH, "engine_canary_write_violations_increased")
    assert series(second, "engine_canary_violations")["increase"] == 0
    # Releases before 0.5.23 named a read's failures without the verify_ prefix.
    record = violation("SWEEP_K_FULL", ["chain_hash", "real_kv_hash"], 2)
    third = read_after(sglang, mtail, second, record, "sglang_kv_canary_verify_violations_total")
    assert (third.verdict, third.reason) == (Verdict.LEAK, "engine_canary_violations_increased")


def test_raise_mode_is_counted_from_the_error_that_stops_the_scheduler(
    mtail: LoggedMtail, sglang: SGLangStub
) -> None:
    first = read(sglang, mtail.url)
    traceback = 'Traceback (most recent call last):\n  File "scheduler.py", line 1, in event_loop'
    record = traceback + "\n" + violation("TAIL_V_SWA", ["verify_real_kv_hash"], 1, raised=True)
    second = read_after(sglang, mtail, first, record, "sglang_kv_canary_verify_violations_total")
    assert (second.verdict, second.reason) == (Verdict.LEAK, "engine_canary_violations_increased")


def test_a_log_page_gone_is_no_pass_and_one_never_configured_says_the_canary_is_missing(
    mtail: LoggedMtail, sglang: SGLangStub
) -> None:
    stop_process(mtail.proc)
    gone = read(sglang, mtail.url)
    assert (gone.verdict, gone.reason) == (Verdict.ERROR, "log_metrics_unreachable")
    assert mtail.url in gone.detail and gone.evidence["log_metrics"]["read"] is False
    # Without a log page, SGLang's own page judges nothing: its canary's counters are not there.
    alone = read(sglang, None)
    assert alone.verdict is Verdict.ERROR and "log_metrics" not in alone.evidence
    assert {"engine_canary_violations", "engine_canary_write_violations"} <= set(alone.evidence["missing"])
