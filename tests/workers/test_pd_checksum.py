"""The PD hand-off checksum (``--kv-checksum``, SGLang's ``--disaggregation-enable-kv-checksum``) and
the defect it exists for (``--bug pd-transfer-corrupt``): the digest in this process, then prefill
and decode servers as processes driven as SGLang's model gateway drives them, then behind the real
gateway (``sglang-router``, skipped without its venv).

Servers: two prefill servers with the checksum, one ``sound`` and one ``corrupt`` (it flips bytes of
every hand-off after the digest); two decode servers, one ``checking`` (the checksum on) and one
``plain`` (off, the default).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import httpx
import pytest
import torch

from kvcanary.processes import free_port
from kvcanary.workers.cli import main
from kvcanary.workers.pd_transfer import (
    BootstrapServer,
    KVHandoff,
    RoomTable,
    fetch_kv,
    flip_signs,
    kv_digest,
)
from tests.support import WorkerProcess
from tests.workers.pd_support import PrefillServer, as_gateway, metric, pd_body, start_servers, stop_servers
from tests.workers.support import PROMPT_A
from tests.workers.test_pd_gateway import need_router, start_gateway

CHECKSUM = ("--kv-checksum",)
CORRUPT = ("--bug", "pd-transfer-corrupt")


# --- the digest, in this process ------------------------------------------------------------------


def test_the_digest_is_adler32_of_the_rows_and_any_flipped_byte_changes_it() -> None:
    k, v = torch.randn(40, 64), torch.randn(40, 64)
    assert kv_digest(k, v) == kv_digest(k.clone(), v.clone())
    flipped = flip_signs(v, 16)
    assert torch.equal(flipped[16:], v[16:]) and torch.equal(flipped[:16], -v[:16])
    assert kv_digest(k, flipped) != kv_digest(k, v)
    assert kv_digest(v, k) != kv_digest(k, v)  # K's bytes first, then V's


def test_the_digest_crosses_the_socket_in_the_header_and_none_is_sent_without_one() -> None:
    rooms, port = RoomTable(timeout=2), free_port()
    server = BootstrapServer(("127.0.0.1", port), rooms)
    server.start()
    try:
        k, v = torch.randn(5, 64), torch.randn(5, 64)
        for room, digest in ((1, kv_digest(k, v)), (2, None)):
            sent = KVHandoff(room, "tenant-a", 7, tuple(range(65, 70)), (3,), k, v, checksum=digest)
            rooms.stage(sent, lambda outcome: None)
            got = fetch_kv("127.0.0.1", port, room, timeout=5)
            assert got.checksum == digest and torch.equal(got.v, v)
    finally:
        server.close()


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--kv-checksum"], "--kv-checksum"),
        (["--mode", "disaggregated", "--kv-checksum"], "--kv-checksum"),
        (["--mode", "decode", "--bug", "pd-transfer-corrupt"], "pd-transfer-corrupt"),
    ],
)
def test_the_checksum_and_the_defect_belong_to_the_pd_servers(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--device", "cpu"])
    assert exited.value.code == 2 and flag in capsys.readouterr().err


# --- the servers as processes, the test playing the gateway ---------------------------------------

Servers = tuple[dict[str, PrefillServer], dict[str, WorkerProcess]]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    timeout = ("--kv-transfer-timeout", "5")
    prefills, decodes = start_servers(
        tmp_path_factory.mktemp("pd-checksum"),
        {"sound": ("reject", *CHECKSUM, *timeout), "corrupt": ("reject", *CHECKSUM, *CORRUPT, *timeout)},
        {"checking": (*CHECKSUM, *timeout), "plain": timeout},
    )
    yield prefills, decodes
    stop_servers(prefills, decodes)


def failures(decode: WorkerProcess) -> tuple[float, float]:
    """Return the decode server's (checksum failures, transfer failures on its side)."""
    return (
        metric(decode.url, "kvcanary_kv_transfer_checksum_failures_total"),
        metric(decode.url, "kvcanary_kv_transfer_failures_total", side="decode"),
    )


def test_each_server_says_whether_it_checksums_as_sglang_does(servers: Servers) -> None:
    prefills, decodes = servers
    for url, on in (
        (prefills["sound"].url, True),
        (decodes["checking"].url, True),
        (decodes["plain"].url, False),
    ):
        assert httpx.get(url + "/server_info").json()["disaggregation_enable_kv_checksum"] is on


def test_a_sound_hand_off_passes_the_check_and_is_decoded(servers: Servers) -> None:
    prefills, decodes = servers
    before = failures(decodes["checking"])
    prefill, decode = as_gateway(prefills["sound"], decodes["checking"], pd_body(PROMPT_A, prefills["sound"]))
    assert prefill.status_code == 200 and decode.status_code == 200, decode.text
    assert decode.json()["choices"][0]["text"] == PROMPT_A[:16]
    assert failures(decodes["checking"]) == before


def test_a_corrupted_hand_off_is_refused_by_a_checking_decode_server_and_counted(servers: Servers) -> None:
    prefills, decodes = servers
    corrupt, checking = prefills["corrupt"], decodes["checking"]
    checksums, transfers = failures(checking)
    prefill, decode = as_gateway(corrupt, checking, pd_body(PROMPT_A, corrupt))
    assert prefill.status_code == 200  # the prefill server handed every byte over
    assert decode.status_code == 500, decode.text
    error = decode.json()["error"]
    assert error["type"] == "kv_checksum_mismatch" and "KV checksum mismatch" in error["message"]
    assert PROMPT_A[:8] not in decode.text
    assert failures(checking) == (checksums + 1, transfers + 1)
    assert metric(corrupt.url, "kvcanary_bug_fired_total", bug="pd-transfer-corrupt") >= 1


def test_without_the_check_the_corrupted_kv_is_decoded_into_a_wrong_answer(servers: Servers) -> None:
    prefills, decodes = servers
    corrupt, plain = prefills["corrupt"], decodes["plain"]
    prefill, decode = as_gateway(corrupt, plain, pd_body(PROMPT_A, corrupt, max_tokens=32))
    assert (prefill.status_code, decode.status_code) == (200, 200)
    text = decode.json()["choices"][0]["text"]
    # The first page's values were flipped: its 16 tokens come out as other bytes (not all of them
    # UTF-8, so the text is not cut by position); the second page is intact.
    assert PROMPT_A[:16] not in text and text.endswith(PROMPT_A[20:32])
    assert failures(plain) == (0, 0)


def test_a_prefill_server_without_the_check_is_decoded_unverified(
    servers: Servers, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # The checking decode server takes a hand-off that carries no digest as it comes, as SGLang
    # admits one whose sender sent none: both sides must have the flag.
    prefills, decodes = start_servers(tmp_path_factory.mktemp("unchecked"), {"bare": ("reject",)}, {})
    try:
        bare, checking = prefills["bare"], servers[1]["checking"]
        before = failures(checking)
        _, decode = as_gateway(bare, checking, pd_body(PROMPT_A, bare))
        assert decode.status_code == 200 and decode.json()["choices"][0]["text"] == PROMPT_A[:16]
        assert failures(checking) == before
    finally:
        stop_servers(prefills, decodes)


# --- behind SGLang's own model gateway ------------------------------------------------------------


def test_behind_the_gateway_the_corrupted_hand_offs_fail_closed_and_each_try_is_counted(
    servers: Servers, tmp_path_factory: pytest.TempPathFactory
) -> None:
    need_router()
    prefills, decodes = servers
    checking = decodes["checking"]
    gateway = start_gateway(tmp_path_factory.mktemp("gw"), [prefills["corrupt"]], [checking])
    try:
        checksums, _ = failures(checking)
        answer = gateway.complete(PROMPT_A + secrets.token_hex(4), max_tokens=16)
        assert answer.status_code == 500, answer.text
        assert PROMPT_A[:8] not in answer.text
        # The gateway retries a 5xx with a new room: every try is corrupted, refused and counted.
        assert failures(checking)[0] - checksums >= 1
    finally:
        gateway.proc.terminate()
        gateway.proc.wait(timeout=10)
