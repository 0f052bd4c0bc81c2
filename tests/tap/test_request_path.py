"""What observe() costs the gateway's request: no work in proportion to the prompt. A real tap posts
to a monitor on a real loopback socket; times are compared as ratios on the same machine."""

from __future__ import annotations

import time

from kvcanary.tap import Tap
from kvcanary.tap.litellm_payload import exchange_of
from kvcanary.tap.record import Exchange
from tests.tap.receiver import Monitor

KEY = b"a-test-fingerprint-key-0123456789"
#: 50 million characters, one in ten not ASCII: 55 MB as UTF-8.
PROMPT = ("é" + "a" * 9) * 5_000_000


def fastest(runs: int, step: object) -> float:
    """Return the fewest seconds ``step()`` took over ``runs`` runs (the least disturbed by others)."""
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        step()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


def test_a_huge_prompt_never_holds_the_gateway_and_its_record_carries_its_bytes(monitor: Monitor) -> None:
    """observe() only queues what it is given; the tap's thread counts the bytes, and in steps: one
    50 MB encode on that thread would hold the interpreter (the GIL) as long as it did on the request
    path, stalling the gateway's event loop all the same. The gateway's thread here observes, then
    ticks until the record is posted: its longest stall, the observe() call included, must be a
    fraction of one whole encode (best of three tries: a loaded machine may stall any one)."""
    encoding = fastest(3, lambda: PROMPT.encode("utf-8"))
    tap = Tap(monitor.server.url, "tok", KEY, gateway="gw", flush_seconds=0.05)
    observing, stalls = float("inf"), []
    for i in range(3):  # each while the tap's thread is idle
        ex = Exchange(f"big-{i}", time.time(), "acme", "team", "http://x/v1", prompt=PROMPT, response="ok")
        start = time.perf_counter()
        tap.observe(ex)
        last = time.perf_counter()
        observing, longest = min(observing, last - start), last - start
        deadline = last + 30
        while len(monitor.records()) < i + 1 and last < deadline:
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
        stalls.append(longest)
    tap.close()
    assert observing < encoding / 20, f"observe {observing * 1e3:.2f} ms, encoding {encoding * 1e3:.1f} ms"
    assert min(stalls) < encoding / 2, (
        f"stalls {[round(s * 1e3, 1) for s in stalls]} ms, encode {encoding * 1e3:.1f}"
    )
    sizes = [r["prompt"] for r in monitor.posted()]
    assert sizes == [{"chars": 50_000_000, "bytes": 55_000_000, "messages": 0}] * 3


def test_a_litellm_payload_of_many_messages_is_read_without_joining_them() -> None:
    """The hook runs on the proxy's event loop: joining a 50 MB conversation there costs what
    encoding it does."""
    half = len(PROMPT) // 2
    payload = {"id": "r", "messages": [{"role": "user", "content": PROMPT[:half]},
                                       {"role": "assistant", "content": PROMPT[half:] + "\n"}]}  # fmt: skip
    joining = fastest(3, lambda: "\n".join([PROMPT[:half], PROMPT[half:] + "\n"]))
    reading = fastest(3, lambda: exchange_of(payload, 200))
    assert reading < joining / 20, f"read {reading * 1e3:.2f} ms, join {joining * 1e3:.1f} ms"
    bounded = exchange_of(payload, 200).bounded()
    assert (bounded.prompt_chars, bounded.prompt_bytes) == (50_000_002, 55_000_002)
