"""The cross-tenant probe: against the reference worker as a process, and a scripted engine at the seam."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvcanary.probes.base import ProbeResult, Verdict
from kvcanary.probes.cross_tenant import DEFAULT_PLANT_CHARS, PLANT_HEADROOM, plant_chars, plant_prompt
from kvcanary.probes.markers import MARKER_RE, MarkerBook
from tests.probes.probe_harness import (
    CLEAN,
    PLACEHOLDER,
    Call,
    FakeEngine,
    Reference,
    answer,
    error,
    probe_once,
    run_probe,
)

# --- against the reference worker ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [*CLEAN, "disaggregated-placeholder"])
def test_it_passes_when_no_tenant_ever_sees_anothers_marker(shared_reference, mode: str) -> None:
    # The defective node passes too: every planted prompt stays under capacity, so this probe never
    # trips the placeholder path on its own (the boundary probe does that on purpose).
    result = probe_once("cross_tenant", shared_reference(mode).target)
    assert (result.verdict, result.reason) == (Verdict.PASS, "no_foreign_marker"), result.detail
    m = result.measurements
    assert (m["requests_sent"], m["requests_answered"], m["plants_answered"], m["reads_answered"]) == (
        8,
        8,
        4,
        4,
    )
    # 16 pages of 16 tokens would be 1,024 bytes; two tenants planting and reading at once get a
    # quarter of the 1,023-token limit.
    assert m["plant_prompt_chars"] == 1023 // 4


def test_it_reports_an_error_not_a_leak_when_the_port_is_unreachable(unreachable: Reference) -> None:
    result = probe_once("cross_tenant", unreachable.target)
    assert (result.verdict, result.reason) == (Verdict.ERROR, "plants_unanswered")
    assert result.measurements["requests_answered"] == 0
    assert result.evidence["failures"][0]["error_kind"] == "connect"


def test_its_planted_markers_come_back_as_a_leak_when_another_tenant_reads_stale_pages(reference) -> None:
    # The scene's own requests fill every page the over-capacity read is handed, on a worker of its
    # own: a shared one may still be finishing an earlier test's request, and pages freed mid-scene
    # go to the front of the free list, ahead of bob's.
    worker = reference(*PLACEHOLDER)
    book = MarkerBook()
    plant = 900  # characters, one token each: 57 pages of 16

    async def scene() -> tuple[ProbeResult, ProbeResult]:
        async with worker.target() as target:
            # Long prompts, as a long-context tenant sends. Bob's plant is the last long request, so
            # its pages lie at the front of the free list behind the probe's small reads (12 pages
            # each). The over-capacity request decodes what its pages hold from position 0 for
            # max_tokens positions: a plant's length reaches bob's plant whichever reads were served.
            # (The boundary's 256 reached four of bob's pages, no whole marker among them, and bob's
            # marker came back only in bob's read: one the probe may go without, as when a loaded
            # worker closed the kept-alive connection it was sent on before reading it.)
            planted = await run_probe("cross_tenant", target, book, plant_chars=plant)
            overflow = await run_probe("boundary", target, book, prime=False, max_tokens=plant)
        return planted, overflow

    planted, overflow = asyncio.run(scene())
    assert planted.verdict is Verdict.PASS
    assert overflow.verdict is Verdict.LEAK, (overflow.reason, overflow.detail)
    assert {(leak["owner_tenant"], leak["reader_tenant"]) for leak in overflow.evidence["leaks"]} == {
        ("bob", "alice")
    }


# --- judgment, with a scripted engine -------------------------------------------------------------------


def run_fake(engine: FakeEngine, tenants: tuple[str, ...] = ("alice", "bob"), **options) -> ProbeResult:
    async def go() -> ProbeResult:
        async with engine.target(tenants) as target:
            return await run_probe("cross_tenant", target, MarkerBook(), **options)

    return asyncio.run(go())


def test_a_reader_handed_another_tenants_planted_text_is_a_leak() -> None:
    last: dict[str, str] = {}

    def shared_cache(call: Call) -> httpx.Response:
        # A prefix cache without a tenant salt: everyone is answered from the latest plant.
        if "reference codes" in call.prompt:
            last["plant"] = call.prompt
            return answer(call, "OK")
        return answer(call, call.markers[0] + "\n" + last.get("plant", ""))

    result = run_fake(FakeEngine(shared_cache), ("alice", "bob", "carol"))
    assert (result.verdict, result.reason) == (Verdict.LEAK, "foreign_marker")
    assert result.evidence["probe_verdict"] == "pass"
    assert result.evidence["leak_count"] >= 2
    assert all(leak["owner_tenant"] != leak["reader_tenant"] for leak in result.evidence["leaks"])


def test_a_leak_in_an_error_body_counts_too() -> None:
    last: dict[str, str] = {}

    def leaky_errors(call: Call) -> httpx.Response:
        if call.tenant == "alice":
            last["alice"] = call.prompt
            return answer(call, "OK")
        return error(400, f"cannot parse: {last.get('alice', '')[:200]}")

    result = run_fake(FakeEngine(leaky_errors))
    assert result.verdict is Verdict.LEAK
    assert result.evidence["leaks"][0]["owner_tenant"] == "alice"


def test_unanswered_plants_are_an_error_because_the_markers_may_never_have_reached_the_cache() -> None:
    def plants_fail(call: Call) -> httpx.Response:
        return error(503, "overloaded") if "reference codes" in call.prompt else FakeEngine.echo(call)

    result = run_fake(FakeEngine(plants_fail))
    assert (result.verdict, result.reason) == (Verdict.ERROR, "plants_unanswered")
    assert result.measurements["plants_answered"] == 0
    assert result.evidence["failures"][0]["status_code"] == 503


def test_too_few_answered_reads_are_an_error() -> None:
    def reads_fail(call: Call) -> httpx.Response:
        return FakeEngine.echo(call) if "reference codes" in call.prompt else error(429, "slow down")

    result = run_fake(FakeEngine(reads_fail))
    assert (result.verdict, result.reason) == (Verdict.ERROR, "reads_unanswered")


def test_one_tenant_is_an_error() -> None:
    engine = FakeEngine()
    result = run_fake(engine, ("alice",))
    assert (result.verdict, result.reason) == (Verdict.ERROR, "too_few_tenants")
    assert engine.calls == []


def test_every_tenant_plants_and_reads_at_once_and_then_one_after_another() -> None:
    engine = FakeEngine(hold_seconds=0.3)  # six requests sent together overlap, however loaded the machine
    result = run_fake(engine, ("alice", "bob", "carol"))
    assert result.verdict is Verdict.PASS
    assert engine.max_in_flight == 6  # the concurrent round: three plants and three reads together
    sequential = [(c.tenant, "reference codes" in c.prompt) for c in engine.calls[6:]]
    assert sequential == [
        ("alice", True),
        ("bob", True),
        ("carol", True),
        ("alice", False),
        ("bob", False),
        ("carol", False),
    ]
    markers = [m for c in engine.calls for m in c.markers]
    owners = {m: c.tenant for c in engine.calls for m in c.markers}
    assert len(set(markers)) == 12 and len(set(owners.values())) == 3


def test_a_planting_prompt_repeats_its_marker_within_its_size() -> None:
    marker = "KVC-0123abcd-" + "f" * 32
    prompt = plant_prompt(marker, 1536)
    assert 1536 - 60 < len(prompt) <= 1536
    assert prompt.count(marker) == len(MARKER_RE.findall(prompt)) >= 24
    assert plant_prompt(marker, 10).count(marker) == 1  # never less than one marker


def test_the_planting_size_spans_sixteen_pages_within_a_share_of_the_limit() -> None:
    assert plant_chars(None, None, 2) == DEFAULT_PLANT_CHARS
    assert plant_chars(64, None, 2) == 16 * 64 * 4
    assert plant_chars(64, 1_048_576, 2) == 16 * 64 * 4
    assert plant_chars(16, 1023, 2) == 1023 // 4
    # An operator may plant more, but never within the headroom of the limit.
    assert plant_chars(16, 1023, 2, stated=5000) == 1023 - PLANT_HEADROOM
    assert plant_chars(16, None, 2, stated=5000) == 5000


def runs_on_one_target(engine: FakeEngine, runs: int) -> list[ProbeResult]:
    async def go() -> list[ProbeResult]:
        async with engine.target() as target:
            return [await run_probe("cross_tenant", target, MarkerBook()) for _ in range(runs)]

    return asyncio.run(go())


def test_one_capacity_reading_sizes_the_plants_of_many_runs() -> None:
    # Every run looked the node up once: at thousands of targets, one request in nine of this probe.
    engine = FakeEngine()
    results = runs_on_one_target(engine, 3)
    assert [r.verdict for r in results] == [Verdict.PASS] * 3
    assert engine.info_reads == 1


class InfoUnavailable(FakeEngine):
    """An engine whose server info answers 503 (warming up, overloaded): a passing failure."""

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/get_server_info", "/server_info"):
            self.info_reads += 1
            return error(503, "warming up")
        return await super().__call__(request)


def test_a_reading_made_while_a_lookup_went_unanswered_is_not_reused() -> None:
    engine = InfoUnavailable()
    results = runs_on_one_target(engine, 2)
    assert [r.verdict for r in results] == [Verdict.PASS] * 2
    assert engine.info_reads == 2 * 2  # each run tries /server_info, then /get_server_info


def test_an_engine_without_server_info_is_not_asked_again_each_run() -> None:
    engine = FakeEngine(info=None)  # 404: the engine has no such endpoint, which will not change
    results = runs_on_one_target(engine, 2)
    assert [r.verdict for r in results] == [Verdict.PASS] * 2
    assert engine.info_reads == 2


def test_a_refused_plant_reads_the_capacity_again() -> None:
    # The engine restarted with a smaller limit: the next run must not keep sending plants over it.
    def refuses_plants(call: Call) -> httpx.Response:
        if "reference codes" in call.prompt:
            return error(400, "Input length exceeds the maximum allowed length")
        return FakeEngine.echo(call)

    engine = FakeEngine(refuses_plants)
    results = runs_on_one_target(engine, 2)
    assert [r.reason for r in results] == ["plants_unanswered"] * 2
    assert engine.info_reads == 1 + 2  # the first reading, then one after each run's refusals


def test_the_planting_size_follows_the_nodes_page_size() -> None:
    engine = FakeEngine(info={"context_length": 1_000_000, "max_total_num_tokens": 2_000_000, "page_size": 4})
    result = run_fake(engine)
    assert result.measurements["plant_prompt_chars"] == 16 * 4 * 4
    assert all(len(c.prompt) <= 256 for c in engine.calls if "reference codes" in c.prompt)
