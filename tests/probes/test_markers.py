"""The marker book: sealed markers are recognised, attributed and aged without storing any of them."""

from __future__ import annotations

import secrets
import sys
import tracemalloc

from kvcanary.probes.markers import MARKER_RE, UNKNOWN_OWNER, MarkerBook, marker_hash, redact_markers


class Clock:
    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_marker_read_by_another_tenant_is_a_hit_naming_its_owner() -> None:
    book = MarkerBook()
    marker_id, marker = book.plant("glm", "alice")
    hits = book.scan(f"stale page: {marker} ...", target="glm", reader="bob")
    assert [(h.marker_id, h.owner_target, h.owner_tenant, h.reader_tenant) for h in hits] == [
        (marker_id, "glm", "alice", "bob")
    ]
    assert hits[0].digest == marker_hash(marker)
    assert marker.split("-")[2] not in hits[0].excerpt  # the secret never reaches evidence


def test_a_tenant_reading_its_own_marker_is_no_hit() -> None:
    book = MarkerBook()
    _, marker = book.plant("glm", "alice")
    assert book.scan(marker, target="glm", reader="alice") == []
    assert len(book.scan(marker, target="other-target", reader="alice")) == 1


def test_marker_shaped_text_the_book_did_not_seal_is_no_hit() -> None:
    book = MarkerBook()
    forged = f"KVC-{secrets.token_hex(4)}-{secrets.token_hex(16)}"
    assert book.scan(forged, target="glm", reader="bob") == []
    _, marker = book.plant("glm", "alice")
    tampered = marker[:-1] + ("0" if marker[-1] != "0" else "1")
    assert book.scan(tampered, target="glm", reader="bob") == []
    assert MarkerBook().scan(marker, target="glm", reader="bob") == []  # another key


def test_markers_expire_with_their_ttl_to_the_minute() -> None:
    clock = Clock()
    book = MarkerBook(ttl_seconds=3600, clock=clock)
    _, marker = book.plant("glm", "alice")
    clock.now += 3600
    assert book.is_live(marker)
    clock.now += 121
    assert not book.is_live(marker)
    assert book.scan(marker, target="glm", reader="bob") == []


def test_a_marker_copied_in_any_case_has_the_digest_it_was_planted_with() -> None:
    book = MarkerBook()
    _, marker = book.plant("glm", "alice")
    hits = book.scan(f"{marker.upper()} and {marker.lower()}", target="glm", reader="bob")
    assert [h.digest for h in hits] == [marker_hash(marker)] * 2


def test_a_marker_from_a_replica_whose_clock_runs_ahead_is_live() -> None:
    ahead, behind = Clock(), Clock()
    ahead.now += 90  # another replica's clock, 90 s ahead of this one (and past a minute boundary)
    key = secrets.token_bytes(32)
    _, marker = MarkerBook(key=key, clock=ahead).plant("glm", "alice")
    book = MarkerBook(key=key, clock=behind)
    book.register("glm", "alice")
    assert book.is_live(marker)
    assert [h.owner_tenant for h in book.scan(marker, target="glm", reader="bob")] == ["alice"]
    behind.now -= 3600  # an hour behind is no clock skew: a sealed minute from the future is refused
    assert not book.is_live(marker)


def test_a_clock_up_to_five_minutes_ahead_is_skew_and_six_is_not() -> None:
    """The allowance said five minutes and accepted four: a marker planted 5 minutes ahead was refused."""
    key = secrets.token_bytes(32)
    for minutes_ahead, live in ((4, True), (5, True), (6, False)):
        ahead, here = Clock(), Clock()
        ahead.now += minutes_ahead * 60
        _, marker = MarkerBook(key=key, clock=ahead).plant("glm", "alice")
        assert MarkerBook(key=key, clock=here).is_live(marker) is live, minutes_ahead


def test_no_live_marker_is_forgotten_however_many_are_planted_and_memory_stays_flat() -> None:
    # The old book kept a hash per marker and, past 200,000, evicted live ones (a leak of an evicted
    # marker went unseen). Sealed markers cost nothing to keep: plant far more than that and check
    # the first one is still recognised, and that planting more leaves the book's memory unchanged.
    book = MarkerBook()
    _, first = book.plant("t0", "alice")
    for i in range(250_000):
        book.plant(f"t{i % 2500}", "alice" if i % 2 else "bob")
    assert book.scan(first, target="t0", reader="bob")[0].owner_target == "t0"
    # Traced over the last 25,000 only: tracemalloc makes every allocation several times slower.
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(25_000):
        book.plant(f"t{i % 2500}", "alice" if i % 2 else "bob")
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    # Nothing per marker: well under 1 MB (a hash per marker would be ~6 MB for 25,000).
    assert grown < 1024 * 1024, grown
    assert sys.getsizeof(book.__dict__) < 4096


def test_replicas_sharing_a_key_recognise_each_others_markers() -> None:
    key = secrets.token_bytes(32)
    planter, reader = MarkerBook(key=key), MarkerBook(key=key)
    _, marker = planter.plant("glm", "alice")
    (hit,) = reader.scan(marker, target="glm", reader="bob")
    assert (hit.owner_target, hit.owner_tenant) == (UNKNOWN_OWNER, UNKNOWN_OWNER)
    reader.register("glm", "alice")
    (hit,) = reader.scan(marker, target="glm", reader="bob")
    assert (hit.owner_target, hit.owner_tenant) == ("glm", "alice")
    assert reader.scan(marker, target="glm", reader="alice") == []


def test_markers_keep_their_published_shape_and_are_redacted_whole_or_cut() -> None:
    book = MarkerBook()
    marker_id, marker = book.plant("glm", "alice")
    assert MARKER_RE.fullmatch(marker)
    assert redact_markers(f"x {marker} y") == f"x KVC-{marker_id}-<redacted> y"
    assert redact_markers(marker[:30]) == f"KVC-{marker_id}-<redacted>"


def test_a_marker_copied_in_upper_case_is_still_recognised_and_redacted() -> None:
    book = MarkerBook()
    marker_id, marker = book.plant("glm", "alice")
    (hit,) = book.scan(f"echo: {marker.upper()}", target="glm", reader="bob")
    assert (hit.marker_id, hit.digest) == (marker_id, marker_hash(marker))
    assert marker.upper()[13:] not in redact_markers(marker.upper())


def test_key_like_strings_are_redacted_from_evidence() -> None:
    text = "use sk-Live_4f9a8b7c6d5e and Bearer abcDEF123456789 or TOKEN_ABCDEFGH1234 then " + "Zq9" * 12
    cleaned = redact_markers(text)
    for secret in ("sk-Live_4f9a8b7c6d5e", "abcDEF123456789", "TOKEN_ABCDEFGH1234", "Zq9" * 12):
        assert secret not in cleaned
    assert redact_markers("the quick brown fox, 1,048,576 tokens") == "the quick brown fox, 1,048,576 tokens"
