"""What a record holds: sizes, fingerprints and names fit for the monitor, and no text or key."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.monitor.traffic.overlap import OWN as MONITOR_OWN
from kvcanary.probes.markers import MARKER_RE as PROBE_MARKER_RE
from kvcanary.probes.markers import MarkerBook
from kvcanary.tap.fingerprints import MAX_TEXT_CHARS, OWN, Fingerprinter
from kvcanary.tap.litellm_payload import exchange_of
from kvcanary.tap.record import MARKER_RE, Exchange, Refusal, summarize

KEY = b"a-test-fingerprint-key-0123456789"
LICENCE = Path("/usr/share/common-licenses/GPL-3").read_text()


def record_of(**fields: object) -> dict[str, object]:
    base: dict[str, object] = dict(
        request_id="r", started=1.8e9, caller="acme", caller_kind="team", api_base="http://x/v1"
    )
    return summarize(Exchange(**{**base, **fields}), Fingerprinter(KEY))  # type: ignore[arg-type]


def test_the_tap_and_the_monitor_agree_on_markers_and_the_own_sign() -> None:
    book = MarkerBook()
    _, marker = book.plant("t", "alice")
    assert MARKER_RE.fullmatch(marker) and PROBE_MARKER_RE.fullmatch(marker)
    assert MONITOR_OWN == OWN
    found = record_of(response=f"here it is: {marker.upper()} and KVC-12345678-nothex")
    assert found["markers"] == [marker.upper()]


def test_a_shared_passage_shares_fingerprints_under_one_key_and_none_under_another() -> None:
    passage = LICENCE[4000:7000]
    a, _ = Fingerprinter(KEY).fingerprints("Intro words here. " + passage)
    b, _ = Fingerprinter(KEY).fingerprints(passage + " and a different ending")
    c, _ = Fingerprinter(b"another-key-of-another-gateway!!").fingerprints(passage)
    assert len(set(a) & set(b)) > 0.8 * len(b) > 50
    assert not set(a) & set(c)
    assert all(0 < f < 2**53 for f in a)


def test_a_huge_prompt_is_cut_to_head_and_tail_with_its_sizes_kept() -> None:
    prompt = "é" + LICENCE * 40  # ~1.4 MB, not ASCII
    queued = Exchange("r", 0.0, "c", "team", "http://x", prompt=prompt, response="ok").bounded()
    assert len(queued.prompt) <= MAX_TEXT_CHARS + 1
    rec = summarize(queued, Fingerprinter(KEY))
    assert rec["prompt"] == {"chars": len(prompt), "bytes": len(prompt.encode()), "messages": 0}
    assert rec["truncated"] is True and len(rec["fingerprints"]["prompt"]) <= 1024  # type: ignore[index]


def test_a_refused_request_is_sent_with_its_refusal_and_sizes_and_no_prints() -> None:
    refusal = Refusal("admission", tokens=9016, kv_pool_tokens=4096)
    rec = record_of(prompt=LICENCE[:9000], status=400, refused=refusal)
    assert rec["refused"] == {"by": "admission", "tokens": 9016, "kv_pool_tokens": 4096, "incident_id": None}
    assert rec["prompt"] == {"chars": 9000, "bytes": len(LICENCE[:9000].encode()), "messages": 0}
    # No engine saw it: nothing of it goes to a window that judges what engines answer.
    assert rec["fingerprints"] == {"prompt": [], "response": []}
    assert rec["distinctive"] == {"prompt": [], "response": []}
    assert TrafficRecord.model_validate(rec).refused is not None  # the monitor reads it
    assert "refused" not in record_of(prompt="served")  # a served request's record is as before


def test_a_quote_of_the_callers_own_prompt_is_marked_own_however_long_the_prompt() -> None:
    prompt = LICENCE * 3  # far more prints than a record sends
    rec = record_of(prompt=prompt, response="As your text says: " + LICENCE[-3000:])
    response = rec["fingerprints"]["response"]  # type: ignore[index]
    assert len(response) > 50 and sum(f == OWN for f in response) >= len(response) - 2  # the intro's are not


def test_names_timings_and_keys_are_made_to_fit_and_no_key_leaves() -> None:
    key = "custom-key-not-sk-0123456789"
    rec = record_of(caller=key, caller_kind="key_hash", key_hash=key, latency_seconds=-3.0, status=42,
                    model_group="evil\x00model" + "x" * 500, ttft_seconds=float("nan"))  # fmt: skip
    text = json.dumps(rec)
    assert key not in text
    assert re.fullmatch("[0-9a-f]{64}", rec["key_hash"]) and rec["caller"] == rec["key_hash"]  # type: ignore[arg-type]
    assert rec["latency_seconds"] is None and rec["ttft_seconds"] is None and rec["status"] == 500
    assert "\x00" not in rec["model_group"]  # type: ignore[operator]
    TrafficRecord.model_validate(rec)  # the monitor takes it
    odd = record_of(model="m\ud800", finish_reason="stop\udfff", request_id="r\ud83d")  # lone surrogates
    TrafficRecord.model_validate_json(json.dumps(odd))  # as the monitor parses a posted batch
    sk = "sk-acme-0001"
    assert (
        record_of(key_hash=hashlib.sha256(sk.encode()).hexdigest())["key_hash"]
        == hashlib.sha256(sk.encode()).hexdigest()
    )
    assert record_of(key_hash="hashed-jwt-" + "ab" * 32)["key_hash"] == "ab" * 32


def test_every_exchange_gets_an_id_of_its_own_and_the_gateways_repeated_id_is_kept_as_data() -> None:
    """An engine that gives every response one id: the records' ids differ
    (the monitor judges each once by its id), the engine's id rides as ``upstream_id``."""
    first, second = record_of(request_id="chatcmpl-same"), record_of(request_id="chatcmpl-same")
    for record in (first, second):
        assert re.fullmatch("tap-[0-9a-f]{24}", record["id"])  # type: ignore[arg-type]
        assert record["upstream_id"] == "chatcmpl-same"
    assert first["id"] != second["id"]
    none = record_of(request_id="")
    assert re.fullmatch("tap-[0-9a-f]{24}", none["id"]) and none["upstream_id"] == ""  # type: ignore[arg-type]
    read = TrafficRecord.model_validate(first)
    assert (read.id, read.upstream) == (first["id"], "chatcmpl-same")
    # Through LiteLLM's payload: neither its id nor litellm_call_id (a client's x-litellm-call-id
    # header when one is sent) becomes the record's id.
    payload = {"id": "chatcmpl-same", "litellm_call_id": "client-chosen", "api_base": "http://x/v1",
               "messages": [{"role": "user", "content": "hi"}], "metadata": {}}  # fmt: skip
    ids = [summarize(exchange_of(payload, 200), Fingerprinter(KEY)) for _ in range(2)]
    assert {r["upstream_id"] for r in ids} == {"chatcmpl-same"} and ids[0]["id"] != ids[1]["id"]
    assert all(re.fullmatch("tap-[0-9a-f]{24}", r["id"]) for r in ids)  # type: ignore[arg-type]


def test_a_record_of_an_older_tap_without_an_upstream_id_reads_as_before() -> None:
    older = {k: v for k, v in record_of(request_id="chatcmpl-1").items() if k != "upstream_id"}
    older["id"] = "chatcmpl-1"  # an older tap sent the gateway's id as the record's
    for read in (TrafficRecord.model_validate(older), TrafficRecord.model_validate_json(json.dumps(older))):
        assert (read.id, read.upstream_id, read.upstream) == ("chatcmpl-1", None, "chatcmpl-1")


def test_litellm_payloads_become_exchanges() -> None:
    payload = {
        "id": "chatcmpl-1", "api_base": "http://127.0.0.1:8000/v1", "model": "openai/m",
        "model_group": "shop",
        "stream": True, "status": "success", "prompt_tokens": 12, "completion_tokens": 3,
        "startTime": 100.0, "endTime": 100.5, "completionStartTime": 100.1,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        "response": {"choices": [{"message": {"content": "hello"}, "finish_reason": "stop"}],
                     "usage": {"prompt_tokens_details": {"cached_tokens": 4}}},
        "metadata": {"user_api_key_hash": "ab" * 32, "user_api_key_alias": "acme-prod",
                     "user_api_key_team_id": "acme"},
    }  # fmt: skip
    ex = exchange_of(payload, 200).bounded()  # the texts are joined on the tap's thread
    assert (ex.caller, ex.caller_kind, ex.prompt, ex.messages, ex.response) == (
        "acme",
        "team",
        "be brief\nhi",
        2,
        "hello",
    )
    assert (ex.finish_reason, ex.cached_tokens, ex.latency_seconds) == ("stop", 4, 0.5)
    assert abs((ex.ttft_seconds or 0) - 0.1) < 1e-9
    del payload["metadata"]["user_api_key_team_id"], payload["metadata"]["user_api_key_alias"]  # type: ignore[attr-defined]
    assert exchange_of(payload, 200).caller_kind == "key_hash"
    payload["messages"] = [{"role": "user", "content": "redacted-by-litellm"}]
    payload["response"] = {"choices": [{"message": {"content": "redacted-by-litellm"}}]}
    redacted = exchange_of(payload, 200).bounded()  # turn_off_message_logging: no text is the placeholder's
    assert (redacted.prompt, redacted.response, redacted.extra) == ("", "", {"redacted": True})
    assert record_of(prompt=redacted.prompt)["prompt"]["chars"] == 0  # unjudged, not 19 characters
