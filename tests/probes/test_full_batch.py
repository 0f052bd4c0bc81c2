"""full_batch: a batch filled with every tenant's requests, parameters mixed, gives each its own answer,
obeying its own parameters.

Against the reference worker with and without its ``batch-crossed`` bug (a full batch of mixed
budgets hands each row another row's tokens) and its ``sampling-rows-stale`` bug (a row that moved
reads another slot's stop strings, allowlist and thinking state), and at the network seam for what
a run sends and how an answer that breaks its own parameters is judged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.probes.base import Verdict
from kvcanary.probes.full_batch import BUDGETS, row_parameters
from kvcanary.probes.markers import MarkerBook
from tests.probes.probe_harness import Call, FakeEngine, answer, run_kind

BATCH = ("--mode", "aggregated", "--kv-pool-tokens", "8192", "--max-batch", "16")
BUGGY = (*BATCH, "--bug", "batch-crossed")
END = "</think>"
REASONING = (*BATCH, "--reasoning-end-str", END)
STALE_ROWS = (*REASONING, "--bug", "sampling-rows-stale")
PARAMETER_REASONS = {"stop_ignored", "token_not_allowed", "foreign_forced_string"}
#: What a row handed another row's tokens shows, by where in its answer the crossing began.
CROSSED = {"foreign_marker", "other_request_marker", "nonce_missing", "token_not_allowed"}


def test_a_worker_keeping_rows_apart_passes_a_batch_of_its_published_size(reference) -> None:  # type: ignore[no-untyped-def]
    verdict, reason, evidence = run_kind("full_batch", reference(*BATCH))
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence
    assert evidence["batch_size"] == 16  # max_running_requests in /get_server_info
    assert len(evidence["tenants"]) == 16


def test_a_worker_crossing_the_rows_of_a_full_mixed_batch_leaks(reference) -> None:  # type: ignore[no-untyped-def]
    verdict, reason, evidence = run_kind("full_batch", reference(*BUGGY))
    # Rows get other rows' tokens from the step the batch filled: another tenant's marker (a leak),
    # or, where the crossing stayed within a tenant (the batch's order follows arrival), another
    # request's (a mismatch); a greedy row that lost its own marker or an allowlisted row handed a
    # token it did not allow is crossed too. Which of these a row shows is the machine's pace: on a
    # quiet machine the rows arrive within a few steps and nearly all carry another's marker whole;
    # on a loaded one the batch fills later, past the early rows' markers (a CI run: one whole
    # marker, the other rows crossed after theirs). The rows that join a full batch are crossed from
    # their first token, whatever the pace.
    assert verdict in (Verdict.LEAK, Verdict.MISMATCH) and reason in CROSSED, evidence
    crossed = [t for t in evidence["tenants"] if t["reason"] in CROSSED]
    assert len(crossed) >= 2, evidence


def test_a_small_batch_does_not_trigger_the_defect(reference) -> None:  # type: ignore[no-untyped-def]
    # The defect needs its trigger: below 8 rows the batch is never grouped.
    verdict, reason, evidence = run_kind("full_batch", reference(*BUGGY), size=4)
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence


def test_rows_that_read_another_rows_parameters_break_their_own(reference) -> None:  # type: ignore[no-untyped-def]
    worker = reference(*STALE_ROWS)
    for _ in range(2):  # the rows' order in the batch follows arrival: each run crosses others
        verdict, reason, evidence = run_kind("full_batch", worker, reasoning_end=END)
        # No marker crosses: each row still copies its own prompt, under another row's parameters.
        assert verdict is Verdict.MISMATCH and reason in PARAMETER_REASONS, evidence
        broken = [t for t in evidence["tenants"] if t["reason"] in PARAMETER_REASONS]
        assert broken and all(t["reason"] != "other_request_marker" for t in evidence["tenants"])
        assert all(t["step"].startswith("row ") and "excerpt" in t for t in broken), broken


def test_a_worker_honouring_every_rows_parameters_passes_with_thinking_rows(reference) -> None:  # type: ignore[no-untyped-def]
    worker = reference(*REASONING)
    for _ in range(2):
        verdict, reason, evidence = run_kind("full_batch", worker, reasoning_end=END)
        assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence


def test_every_row_carries_its_own_stop_string_in_its_prompt_before_its_budget() -> None:
    for i in range(40):
        row = row_parameters(i, "reference", True, END)
        prompt = row.prompt("KVC-00000000-" + "0" * 32)
        assert prompt.find(row.stop) == row.stop_at < row.fields["max_tokens"] <= len(prompt)
        assert row.fields["extra"]["stop"] == [row.stop]
        assert (row.allowed is not None) == (i % 4 == 1)
        assert (row.thinking is not None) == (i % 4 == 2)
        if row.thinking is not None:  # its own answer ends on its stop before the end is forced
            assert row.thinking > row.stop_at + len(row.stop)
    # Token ids are known on the byte tokenizer only; thinking rows need the end string stated.
    assert all(row_parameters(i, "vllm", True, END).allowed is None for i in range(8))
    assert all(row_parameters(i, "sglang", True, END).thinking is None for i in range(8))
    assert all(row_parameters(i, "reference", True).thinking is None for i in range(8))


def test_rows_vary_their_parameters_and_every_choice_is_scanned() -> None:
    fake = FakeEngine()

    async def reply(call: Call) -> httpx.Response:
        """The echo; asked for two choices, the second carries a marker another tenant was given."""
        if call.body.get("n") != 2:
            return FakeEngine.echo(call)
        await asyncio.sleep(0.05)  # every row has arrived by now
        foreign = next(m for c in fake.calls if c.tenant != call.tenant for m in c.markers)
        choices = [{"message": {"content": call.prompt[:70]}, "finish_reason": "stop"},
                   {"message": {"content": f"also: {foreign}"}, "finish_reason": "stop"}]  # fmt: skip
        return httpx.Response(
            200, json={"choices": choices, "usage": {"prompt_tokens": 40, "completion_tokens": 9}}
        )

    fake.reply = reply
    verdict, _, _, evidence = _run(fake, "vllm", {"size": 10, "repeats": True, "reasoning_end": END})
    rows = [c for c in fake.calls if "Remember this code" in c.prompt]
    assert len(rows) == 10
    bodies = [c.body for c in rows]
    assert {b["max_tokens"] for b in bodies} == set(BUDGETS)
    assert sum(b["temperature"] > 0 for b in bodies) == 6  # every second row, and the n = 2 ones
    assert sum(b.get("repetition_penalty") == 1.1 for b in bodies) == 3
    assert len({tuple(b["stop"]) for b in bodies}) == 10  # a stop string of its own each
    assert [b.get("n") for b in bodies].count(2) == 2 and all(not b["stream"] for b in bodies if b.get("n"))
    assert sum("thinking_token_budget" in b for b in bodies) == 2  # rows 2 and 6 (vLLM takes it)
    assert not any("allowed_token_ids" in b for b in bodies)  # vLLM's token ids are not bytes
    # The marker in a second choice is found: another tenant's, so a leak.
    assert verdict is Verdict.LEAK, evidence


def _run(fake: FakeEngine, engine: str, options: dict[str, Any]) -> tuple[Verdict, str, str, dict[str, Any]]:
    async def go() -> tuple[Verdict, str, str, dict[str, Any]]:
        async with fake.target(engine=engine) as target:
            config = target._config.model_copy(
                update={"probes": ["full_batch"], "options": {"full_batch": options}}
            )
            result, _ = await execute_probe("full_batch", target, MarkerBook(), config)
        return result.verdict, result.reason, result.detail, result.evidence

    return asyncio.run(go())


def _obeying(call: Call, text: str) -> str:
    """Return ``text`` as an engine honouring the call's allowlist writes it."""
    allowed = call.body.get("allowed_token_ids")
    return "".join(c for c in text if not allowed or ord(c) in allowed)


def _overspent(call: Call) -> httpx.Response:
    body = {"choices": [{"message": {"content": call.prompt[:70]}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 200, "completion_tokens": call.body["max_tokens"] + 1}}  # fmt: skip
    return httpx.Response(200, json=body)


def _past_stop(call: Call) -> httpx.Response:
    stop = call.body["stop"][0]
    return answer(call, call.prompt[: call.prompt.find(stop) + len(stop)])


#: One row's answer breaking one of its own parameters: (the row, its answer, the reason it earns,
#: what the detail must name).
BREAKS: dict[str, tuple[int, Callable[[Call], httpx.Response], str, str]] = {
    "its own stop string sent": (0, _past_stop, "stop_ignored", "'<stop-000>'"),
    "a token outside its allowlist": (
        1,
        lambda call: answer(call, _obeying(call, call.prompt[:70]) + "!"),
        "token_not_allowed",
        "'!'",
    ),
    "the reasoning end forced into it": (
        4,
        lambda call: answer(call, call.prompt[:70] + END),
        "foreign_forced_string",
        repr(END),
    ),
    "more tokens than its budget": (0, _overspent, "budget_exceeded", "at most 128 tokens"),
}


@pytest.mark.parametrize("broken", list(BREAKS))
def test_an_answer_breaking_its_own_parameters_is_a_mismatch_naming_the_parameter(broken: str) -> None:
    target_row, breaks, reason, named = BREAKS[broken]

    def reply(call: Call) -> httpx.Response:
        # Row numbers are in the stop strings; every other row answers its question, stopping on time.
        if call.body["stop"] == [f"<stop-{target_row:03d}>"]:
            return breaks(call)
        return answer(call, _obeying(call, call.prompt[:70]))

    options = {"size": 6, "repeats": True, "stream": False, "reasoning_end": END}
    verdict, got, detail, evidence = _run(FakeEngine(reply=reply), "reference", options)
    assert (verdict, got) == (Verdict.MISMATCH, reason), evidence
    assert [t["step"] for t in evidence["tenants"] if t["reason"] == reason] == [f"row {target_row}"]
    assert f"row {target_row}" in detail and named in detail, detail


def test_an_answer_obeying_its_parameters_passes_however_it_is_wrapped() -> None:
    def reply(call: Call) -> httpx.Response:
        return answer(call, _obeying(call, "Sure: " + call.prompt[:70]))

    options = {"size": 8, "repeats": True, "reasoning_end": END}
    verdict, reason, _, evidence = _run(FakeEngine(reply=reply), "reference", options)
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence
