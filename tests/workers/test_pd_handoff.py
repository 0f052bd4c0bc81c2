"""Prefill and decode as separate servers: the socket hand-off, the flags, and both servers as real
processes driven the way SGLang's model gateway drives them (without the gateway, for speed; the
gateway itself is in ``test_pd_gateway.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch

from kvcanary.processes import free_port
from kvcanary.workers.cli import build_parser, config_from_args, main
from kvcanary.workers.pd_serving import DecodeEngine, PrefillEngine
from kvcanary.workers.pd_transfer import (
    BootstrapServer,
    HandoffFailed,
    KVHandoff,
    RoomTable,
    abandon_room,
    fetch_kv,
)
from kvcanary.workers.request import FinishEvent
from tests.support import WorkerProcess
from tests.workers.pd_support import PrefillServer, as_gateway, metric, pd_body, start_servers, stop_servers
from tests.workers.support import (
    CANARY,
    OVER_CAPACITY_PROMPT,
    PROMPT_A,
    Collector,
    run_until_idle,
    small_config,
)

# --- the socket hand-off, in this process -----------------------------------------------------------


#: How long a room waits in these tests: long enough that a loaded machine never lets one expire
#: by its pace; "at once" is held to half of it.
ROOM_WAIT_SECONDS = 6.0
AT_ONCE_SECONDS = ROOM_WAIT_SECONDS / 2


def listening(timeout: float) -> Iterator[tuple[RoomTable, int]]:
    rooms = RoomTable(timeout=timeout)
    port = free_port()
    server = BootstrapServer(("127.0.0.1", port), rooms)
    server.start()
    yield rooms, port
    server.close()


@pytest.fixture
def bootstrap() -> Iterator[tuple[RoomTable, int]]:
    """A bootstrap listener on a free port whose rooms wait :data:`ROOM_WAIT_SECONDS`."""
    yield from listening(ROOM_WAIT_SECONDS)


@pytest.fixture
def expiring() -> Iterator[tuple[RoomTable, int]]:
    """A bootstrap listener whose rooms wait 0.5 s: for the rooms that are meant to expire."""
    yield from listening(0.5)


def handoff(room: int, num_tokens: int = 5) -> KVHandoff:
    k = torch.randn(num_tokens, 64)
    return KVHandoff(
        room=room,
        tenant="tenant-a",
        request_id=7,
        input_ids=tuple(range(65, 65 + num_tokens)),
        src_pages=(3, 4),
        k=k,
        v=k * 2,
    )


class Outcome:
    """What a staged room's ``on_done`` was told, and when."""

    def __init__(self) -> None:
        self.told: list[bool | int] = []
        self.called = threading.Event()

    def __call__(self, sent: bool | int) -> None:
        self.told.append(sent)
        self.called.set()


def test_it_hands_a_rooms_rows_to_the_decode_side_and_says_when_they_arrived(
    bootstrap: tuple[RoomTable, int],
) -> None:
    rooms, port = bootstrap
    outcome = Outcome()
    sent = handoff(2**63 - 1, num_tokens=20)
    rooms.stage(sent, outcome)
    got = fetch_kv("127.0.0.1", port, sent.room, timeout=5)
    assert outcome.called.wait(5) and outcome.told == [True]
    assert (got.room, got.tenant, got.request_id, got.input_ids) == (sent.room, "tenant-a", 7, sent.input_ids)
    assert got.src_pages == (3, 4) and got.num_tokens == 20
    assert torch.equal(got.k, sent.k) and torch.equal(got.v, sent.v)


def test_it_waits_for_a_room_staged_after_the_decode_side_asked(bootstrap: tuple[RoomTable, int]) -> None:
    rooms, port = bootstrap
    sent = handoff(42)
    threading.Timer(0.1, rooms.stage, (sent, Outcome())).start()
    assert fetch_kv("127.0.0.1", port, 42, timeout=5).input_ids == sent.input_ids


def test_it_answers_a_refused_room_with_the_prefill_status_at_once(bootstrap: tuple[RoomTable, int]) -> None:
    rooms, port = bootstrap
    rooms.refuse(9, 400, "Input length (1500 tokens) exceeds the maximum allowed length (1023 tokens).")
    started = time.monotonic()
    with pytest.raises(HandoffFailed) as failed:
        fetch_kv("127.0.0.1", port, 9, timeout=5)
    assert failed.value.status == 400 and "1023 tokens" in failed.value.message
    assert time.monotonic() - started < AT_ONCE_SECONDS  # not the room's wait


def test_it_fails_a_room_nobody_staged_and_one_nobody_fetched(expiring: tuple[RoomTable, int]) -> None:
    rooms, port = expiring
    with pytest.raises(HandoffFailed) as failed:
        fetch_kv("127.0.0.1", port, 5, timeout=5)
    assert failed.value.status == 500 and "not staged" in failed.value.message
    outcome = Outcome()
    rooms.stage(handoff(6), outcome)
    assert outcome.called.wait(3) and outcome.told == [False]
    with pytest.raises(HandoffFailed):  # and the expired room is gone
        fetch_kv("127.0.0.1", port, 6, timeout=5)


def test_a_room_the_decode_side_abandoned_is_let_go_at_once_before_or_after_it_was_staged(
    bootstrap: tuple[RoomTable, int],
) -> None:
    rooms, port = bootstrap
    staged_first = Outcome()
    rooms.stage(handoff(11), staged_first)
    abandon_room("127.0.0.1", port, 11, 400, timeout=5)
    assert staged_first.called.wait(AT_ONCE_SECONDS) and staged_first.told == [400]  # not expired: False
    abandon_room("127.0.0.1", port, 12, 400, timeout=5)
    deadline = time.monotonic() + AT_ONCE_SECONDS  # the word is sent and forgotten: wait for the listener
    while 12 not in rooms._abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    staged_after = Outcome()
    rooms.stage(handoff(12), staged_after)
    assert staged_after.told == [400]  # told as it was staged
    with pytest.raises(HandoffFailed):  # and neither room is offered any more
        fetch_kv("127.0.0.1", port, 11, timeout=5)


def test_it_fails_with_a_500_when_the_prefill_server_cannot_be_reached() -> None:
    with pytest.raises(HandoffFailed) as failed:
        fetch_kv("127.0.0.1", free_port(), 1, timeout=2)
    assert failed.value.status == 500


#: Seconds a staged hand-off waits for its decode server (--kv-transfer-timeout) in the servers below.
HANDOFF_TIMEOUT = 8

PREFILL = ["--mode", "prefill", "--bootstrap-port", "5000"]


# --- the two engines, in this process -----------------------------------------------------------------


@pytest.fixture
def prefill_engine() -> Iterator[PrefillEngine]:
    """A prefill server's engine on the small pool with a shared prefix cache, its thread running."""
    config = small_config(
        mode="prefill", bootstrap_port=free_port(), prefix_cache="shared", decode_pool_tokens=None
    )
    engine = PrefillEngine(config)
    engine.start()
    yield engine
    engine.stop()


def prefill_room(engine: PrefillEngine, room: int, text: str) -> tuple[KVHandoff, Collector]:
    """Submit ``text`` under ``room``, fetch its K/V as a decode server would, and wait for the finish."""
    collector = Collector()
    engine.submit_room(room, list(text.encode()), 16, tenant="tenant-a", emit=collector)
    assert engine.config.bootstrap_port is not None
    got = fetch_kv("127.0.0.1", engine.config.bootstrap_port, room, timeout=5)
    deadline = time.monotonic() + 5
    while not collector.events and time.monotonic() < deadline:
        time.sleep(0.01)
    return got, collector


def test_prefill_and_decode_engines_hand_over_the_prompt_and_decode_it(prefill_engine: PrefillEngine) -> None:
    text = "the prompt crosses a socket between two engines"
    sent, prefilled = prefill_room(prefill_engine, 11, text)
    assert isinstance(prefilled.last, FinishEvent) and prefilled.last.prompt_tokens == len(text)
    assert prefill_engine.prompt_pages.can_alloc(64)  # its pages are given back (cached ones evictable)
    decode = DecodeEngine(small_config(mode="decode", prefill_pool_tokens=None))
    decoded = Collector()
    plan = decode.plan(list(text.encode()), len(text))
    decode.enqueue_received(plan, sent, tenant="tenant-a", emit=decoded)
    run_until_idle(decode)
    assert decoded.text == text and isinstance(decoded.last, FinishEvent)
    assert decoded.last.prompt_tokens == len(text)


def test_a_prefix_cache_hit_on_the_prefill_server_hands_over_the_same_rows(
    prefill_engine: PrefillEngine,
) -> None:
    text = PROMPT_A[:100]
    first, _ = prefill_room(prefill_engine, 21, text)
    second, finished = prefill_room(prefill_engine, 22, text)
    assert isinstance(finished.last, FinishEvent) and finished.last.cached_tokens == 96  # six full pages
    assert torch.equal(first.k, second.k) and torch.equal(first.v, second.v)


def test_a_prefill_request_aborted_before_its_room_was_staged_fails_the_decode_side_at_once() -> None:
    port = free_port()
    engine = PrefillEngine(small_config(mode="prefill", bootstrap_port=port, decode_pool_tokens=None))
    engine.bootstrap.start()  # the engine is driven without its thread
    try:
        request = engine.submit_room(31, list(b"never computed"), 4, tenant="tenant-a", emit=Collector())
        engine.abort(request)
        engine.admit_waiting()
        started = time.monotonic()
        with pytest.raises(HandoffFailed, match="aborted"):
            fetch_kv("127.0.0.1", port, 31, timeout=5)
        assert time.monotonic() - started < 15  # not the room's 30 s wait
    finally:
        engine.bootstrap.close()


def test_a_decode_engine_refuses_more_positions_than_the_prompt_it_planned() -> None:
    decode = DecodeEngine(small_config(mode="decode", prefill_pool_tokens=None))
    plan = decode.plan(list(b"short"), 5)
    with pytest.raises(ValueError, match="prefill sent 20 positions"):
        decode.enqueue_received(plan, handoff(1, num_tokens=20), tenant="tenant-a", emit=Collector())


# --- flags -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--mode", "prefill"], "--bootstrap-port"),
        (["--mode", "decode", "--bootstrap-port", "5000"], "--bootstrap-port"),
        (["--bootstrap-port", "5000"], "--bootstrap-port"),
        (["--mode", "prefill", "--bootstrap-port", "70000"], "--bootstrap-port"),
        (["--mode", "prefill", "--bootstrap-port", "30000", "--port", "30000"], "--bootstrap-port"),
        ([*PREFILL, "--decode-pool-tokens", "4096"], "--decode-pool-tokens"),
        ([*PREFILL, "--prefill-pool-tokens", "10"], "--prefill-pool-tokens"),
        (["--mode", "decode", "--prefill-pool-tokens", "1024"], "--prefill-pool-tokens"),
        (["--mode", "decode", "--decode-pool-tokens", "10"], "--decode-pool-tokens"),
        (["--mode", "decode", "--admission", "placeholder"], "--admission"),
        (["--mode", "decode", "--prefix-cache", "shared"], "--prefix-cache"),
        (["--mode", "decode", "--session-cache", "4"], "--session-cache"),
        (["--mode", "decode", "--kv-transfer-timeout", "0"], "--kv-transfer-timeout"),
    ],
)  # fmt: skip
def test_it_exits_2_naming_the_flag_of_a_bad_pd_combination(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--device", "cpu"])
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err


def test_each_server_has_only_its_own_pool() -> None:
    parse = build_parser().parse_args
    prefill = config_from_args(
        parse(
            ["--mode", "prefill", "--bootstrap-port", "5000", "--kv-pool-tokens", "2048", "--device", "cpu"]
        )
    )
    decode = config_from_args(parse(["--mode", "decode", "--decode-pool-tokens", "4096", "--device", "cpu"]))
    assert prefill.pool_tokens == {"prefill": 2048} and prefill.max_req_input_len == 2047
    assert decode.pool_tokens == {"decode": 4096} and decode.max_req_input_len == 4095
    assert (prefill.effective_admission, decode.effective_admission) == ("reject", "reject")


# --- both servers as processes, the test playing the gateway -----------------------------------------


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[dict[str, PrefillServer], dict[str, WorkerProcess]]]:
    """``placeholder`` and ``reject`` prefill servers; ``plain`` and ``verified`` decode servers.
    Hand-offs time out after 8 s: the failures below wait it out, and what must be quicker than it
    is held to half of it (a bound of 1.5 s against 2 s failed once on a loaded 2-core machine)."""
    timeout = ("--kv-transfer-timeout", str(HANDOFF_TIMEOUT))
    prefills, decodes = start_servers(
        tmp_path_factory.mktemp("pd"),
        {"placeholder": ("placeholder", *timeout), "reject": ("reject", *timeout)},
        {
            "plain": timeout,
            "verified": ("--verify-ownership", *timeout),
            "narrow": ("--decode-pool-tokens", "512", *timeout),
        },
    )
    yield prefills, decodes
    stop_servers(prefills, decodes)


Servers = tuple[dict[str, PrefillServer], dict[str, WorkerProcess]]


def test_the_servers_describe_themselves_as_sglang_does(servers: Servers) -> None:
    prefills, decodes = servers
    for url, mode, pool in (
        (prefills["placeholder"].url, "prefill", 1024),
        (decodes["plain"].url, "decode", 4096),
    ):
        for path in ("/server_info", "/get_server_info"):
            info = httpx.get(url + path).json()
            assert info["disaggregation_mode"] == mode and info["dp_size"] == 1
            assert (info["max_total_num_tokens"], info["max_req_input_len"]) == (pool, pool - 1)
            assert info["context_len"] == 8192 and info["page_size"] == 16 and info["version"]
        for path in ("/model_info", "/get_model_info"):
            assert httpx.get(url + path).json()["is_generation"] is True
    assert httpx.get(prefills["placeholder"].url + "/server_info").json()["bootstrap_port"] == (
        prefills["placeholder"].bootstrap_port
    )


def test_a_completion_is_the_copied_prompt_with_its_kv_from_the_prefill_server(servers: Servers) -> None:
    prefills, decodes = servers
    prefill, decode = as_gateway(prefills["reject"], decodes["plain"], pd_body(PROMPT_A, prefills["reject"]))
    assert prefill.status_code == 200 and prefill.json()["usage"]["prompt_tokens"] == len(PROMPT_A)
    assert decode.status_code == 200, decode.text
    assert decode.json()["choices"][0]["text"] == PROMPT_A[:16]
    assert decode.json()["usage"]["prompt_tokens"] == len(PROMPT_A)
    assert float(decode.headers["x-kvcanary-kv-transfer-seconds"]) > 0


def test_the_placeholder_prefill_server_leaks_another_tenants_text_through_the_decode_server(
    servers: Servers,
) -> None:
    prefills, decodes = servers
    placeholder, plain = prefills["placeholder"], decodes["plain"]
    assert as_gateway(placeholder, plain, pd_body(PROMPT_A, placeholder))[1].status_code == 200
    body = pd_body(OVER_CAPACITY_PROMPT, placeholder, max_tokens=200)
    prefill, decode = as_gateway(placeholder, plain, body, key="sk-b")
    assert prefill.status_code == 200 and prefill.json()["usage"]["prompt_tokens"] == 1
    assert decode.status_code == 200
    assert CANARY in decode.json()["choices"][0]["text"]
    assert decode.json()["usage"]["prompt_tokens"] == 1
    assert metric(placeholder.url, "kvcanary_placeholder_substitutions_total") >= 1


def test_a_verifying_decode_server_fails_the_placeholder_request_closed(servers: Servers) -> None:
    prefills, decodes = servers
    placeholder, verified = prefills["placeholder"], decodes["verified"]
    assert as_gateway(placeholder, verified, pd_body(PROMPT_A, placeholder))[1].status_code == 200
    _, decode = as_gateway(placeholder, verified, pd_body(OVER_CAPACITY_PROMPT, placeholder, max_tokens=200))
    assert decode.status_code == 500 and decode.json()["error"]["type"] == "kv_ownership_violation"
    assert CANARY not in decode.text
    assert metric(verified.url, "kvcanary_kv_ownership_violations_total") >= 1


def test_a_refusal_of_the_prefill_server_is_the_decode_servers_400_at_once(servers: Servers) -> None:
    prefills, decodes = servers
    plain = decodes["plain"]
    failed = metric(plain.url, "kvcanary_kv_transfer_failures_total", side="decode")
    prefill, decode = as_gateway(prefills["reject"], plain, pd_body(OVER_CAPACITY_PROMPT, prefills["reject"]))
    assert prefill.status_code == 400 and "(1023 tokens)" in prefill.json()["error"]["message"]
    assert decode.status_code == 400 and "(1023 tokens)" in decode.json()["error"]["message"]
    # The decode server did not wait out its hand-off (that is a transfer failure, counted), whatever
    # the machine's pace: a bound on the time failed beside a second suite (5.0 s against 4).
    assert metric(plain.url, "kvcanary_kv_transfer_failures_total", side="decode") == failed


def test_a_refusal_of_the_decode_server_is_the_prefill_servers_too_and_frees_its_pages_at_once(
    servers: Servers,
) -> None:
    """A prompt the prefill pool holds and the decode pool never can: without a word from the decode
    server the prefill server would hold the room's pages for its whole hand-off timeout, and a
    pool filled with such rooms makes even small requests wait."""
    prefills, decodes = servers
    reject, narrow = prefills["reject"], decodes["narrow"]
    failed = metric(reject.url, "kvcanary_kv_transfer_failures_total", side="prefill")
    prefill, decode = as_gateway(reject, narrow, pd_body("y" * 800, reject))
    assert decode.status_code == 400 and "(511 tokens)" in decode.json()["error"]["message"], decode.text
    assert prefill.status_code == 400 and prefill.json()["error"]["type"] == "decode_refused", prefill.text
    # Not the hand-off timeout: a room that expires is a transfer failure, counted.
    assert metric(reject.url, "kvcanary_kv_transfer_failures_total", side="prefill") == failed
    assert metric(reject.url, "kvcanary_kv_pages_free", pool="prefill") == 64  # all given back


def test_a_room_the_prefill_server_never_got_fails_the_decode_server_with_a_500(servers: Servers) -> None:
    prefills, decodes = servers
    plain = decodes["plain"]
    before = metric(plain.url, "kvcanary_kv_transfer_failures_total", side="decode")
    answer = httpx.post(
        f"{plain.url}/v1/completions",
        json=pd_body("lost room", prefills["placeholder"]),
        headers={"Authorization": "Bearer sk-a"},
        timeout=30,
    )
    assert answer.status_code == 500 and answer.json()["error"]["type"] == "kv_transfer_failed"
    assert metric(plain.url, "kvcanary_kv_transfer_failures_total", side="decode") == before + 1


def test_a_room_no_decode_server_fetched_fails_the_prefill_server_and_frees_its_pages(
    servers: Servers,
) -> None:
    prefills, _ = servers
    placeholder = prefills["placeholder"]
    before = metric(placeholder.url, "kvcanary_kv_transfer_failures_total", side="prefill")
    answer = httpx.post(
        f"{placeholder.url}/v1/completions",
        json=pd_body("x" * 1000, placeholder),
        headers={"Authorization": "Bearer sk-a"},
        timeout=30,
    )
    assert answer.status_code == 500 and answer.json()["error"]["type"] == "kv_transfer_failed"
    assert metric(placeholder.url, "kvcanary_kv_transfer_failures_total", side="prefill") == before + 1
    assert metric(placeholder.url, "kvcanary_kv_pages_free", pool="prefill") == 64  # all given back


def test_a_prefill_request_whose_client_left_frees_its_staged_room_before_the_hand_off_times_out(
    servers: Servers,
) -> None:
    """A gateway (or kvcanary's path run) whose decode leg failed closes the prefill leg: the room
    nobody will fetch is let go then, not after ``--kv-transfer-timeout`` (8 s here)."""
    prefills, _ = servers
    reject = prefills["reject"]
    aborted = metric(reject.url, "kvcanary_requests_aborted_total")
    failed = metric(reject.url, "kvcanary_kv_transfer_failures_total", side="prefill")
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):  # the client leaves; nobody ever fetches the room
        httpx.post(
            f"{reject.url}/v1/completions",
            json=pd_body("z" * 1000, reject),
            headers={"Authorization": "Bearer sk-a"},
            timeout=httpx.Timeout(10, read=0.3),
        )
    while metric(reject.url, "kvcanary_kv_pages_free", pool="prefill") < 64:
        assert time.monotonic() - started < 60, "the room's pages were never given back"
        time.sleep(0.05)
    assert metric(reject.url, "kvcanary_requests_aborted_total") == aborted + 1
    # Let go by the abort, not by the room's expiry (a transfer failure, counted), at any pace.
    failures = metric(reject.url, "kvcanary_kv_transfer_failures_total", side="prefill")
    assert failures == failed, "the room's pages were held until it expired"


def test_a_body_without_bootstrap_fields_is_a_400_naming_them(servers: Servers) -> None:
    prefills, decodes = servers
    for url in (prefills["reject"].url, decodes["plain"].url):
        answer = httpx.post(
            f"{url}/v1/completions",
            json={"model": "kvcanary-reference", "prompt": "hello"},
            headers={"Authorization": "Bearer sk-a"},
        )
        assert answer.status_code == 400 and "bootstrap_room" in answer.text
