"""Cache salts in the reference worker: by header as by body, and in each cache tier.

The worker runs in process (``serve``), its engine thread included; each defect is checked against
the worker without its flag, which is its fix.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi.testclient import TestClient

from kvcanary.workers.cache_salt import resolve_salt
from tests.workers.support import complete

PROMPT = "q" * 100  # six whole 16-token pages a hit can serve
HEADER = "x-tenant-id"


def cached(client: TestClient, *, salt: str | None = None, header: str | None = None) -> int:
    """Send PROMPT under a body salt, a header salt, or both; return the cached tokens reported."""
    headers = {HEADER: header} if header is not None else {}
    body = {"model": "kvcanary-reference", "prompt": PROMPT, "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    answer = client.post("/v1/completions", json=body, headers=headers)
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_salt_header_wins_over_the_body_and_an_empty_one_counts_as_absent() -> None:
    assert resolve_salt("tenant-a", "tenant-b") == "tenant-a"
    assert resolve_salt("  tenant-a ", None) == "tenant-a"
    assert resolve_salt("  ", "tenant-b") == "tenant-b"
    assert resolve_salt(None, None) is None


def test_the_header_names_the_cache_domain_whatever_the_body_says(serve: Callable[..., TestClient]) -> None:
    client = serve(prefix_cache="shared", cache_salt_header=HEADER)
    assert cached(client, header="a") == 0
    assert cached(client, header="a") == 96
    assert cached(client, header="b") == 0  # another header, another domain
    assert cached(client, header="c", salt="a") == 0  # a body naming a's domain stays in c's
    assert cached(client, salt="a") == 96  # with no header the body's salt is the domain, as before


def test_with_the_defect_a_body_salt_takes_the_request_into_another_domain(
    serve: Callable[..., TestClient],
) -> None:
    client = serve(prefix_cache="shared", cache_salt_header=HEADER, bugs=frozenset({"salt-body-over-header"}))
    cached(client, header="a")
    assert cached(client, header="c", salt="a") == 96  # served from a's domain: the client chose it
    assert cached(client, header="d") == 0  # a header alone still separates


def test_without_the_flag_the_header_is_not_read(serve: Callable[..., TestClient]) -> None:
    client = serve(prefix_cache="shared")
    cached(client, header="a")
    assert cached(client, header="b") == 96  # both unsalted: the header means nothing to this worker


def churn(client: TestClient, slots: int) -> None:
    """Send as many other sequences as the session ring holds, so it moves on."""
    for letter in "vwxyz"[:slots]:
        complete(client, letter * 100, max_tokens=1)


def test_the_offload_tier_keeps_each_salt_apart(serve: Callable[..., TestClient]) -> None:
    client = serve(session_cache=2)
    cached(client, salt="a")
    churn(client, 2)
    assert cached(client, salt="b") == 0
    assert cached(client, salt="a") == 96  # from the offload tier: the ring moved on


def test_with_the_defect_the_offload_tier_serves_another_salts_sequence(
    serve: Callable[..., TestClient],
) -> None:
    client = serve(session_cache=2, bugs=frozenset({"offload-salt-dropped"}))
    cached(client, salt="a")
    assert cached(client, salt="b") == 96  # the ring kept them apart; the tier below did not
    offload = client.get("/metrics").text
    assert 'kvcanary_cached_tokens_by_tier_total{tier="offload"} 96.0' in offload
    assert 'kvcanary_bug_fired_total{bug="offload-salt-dropped"} 1.0' in offload
