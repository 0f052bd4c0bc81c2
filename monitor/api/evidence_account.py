"""A result's evidence told in a few lines a person on call reads at a glance: whose marker came
back to whom, the sizes sent and reported, the pool against the window, the gateway records that
failed. The incident page shows these above the raw JSON, which it folds away.

Text only, from the stored evidence's own keys (the probes' and the traffic checks'); a key this
module does not know is simply not told, and stays in the raw JSON. Excerpts are never told: the
page drops them before this sees the evidence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

#: Lines told at most per result: an account, not a second dump.
MAX_LINES = 6
#: Gateway records named at most in a line.
MAX_RECORDS = 3


def account(evidence: Mapping[str, Any], target: str | None = None) -> list[str]:
    """Return at most ``MAX_LINES`` short lines telling ``evidence``, in the order a reader needs them.
    ``target`` is the result's own target: a marker of it is not named by it again."""
    lines: list[str] = []
    for tell in _TELLERS:
        lines += tell(evidence, target)
    return lines[:MAX_LINES]


def tells_sizes(evidence: Mapping[str, Any]) -> bool:
    """Whether the account says the sizes sent and reported (the page's figures then need not)."""
    return bool(_sizes(evidence, None))


def _leaks(evidence: Mapping[str, Any], target: str | None) -> Iterable[str]:
    leaks = [leak for leak in evidence.get("leaks") or [] if isinstance(leak, dict)]
    if not leaks:
        return []
    told = [
        f"marker {leak.get('marker_id', '?')} of {leak.get('owner_tenant', '?')}"
        + (f" ({leak['owner_target']})" if leak.get("owner_target") not in (None, "", target) else "")
        + f" came back to {leak.get('reader_tenant', '?')}"
        for leak in leaks[:MAX_RECORDS]
    ]
    count, times = evidence.get("leak_count", len(leaks)), evidence.get("leak_occurrences")
    times = times if isinstance(times, int) and not isinstance(times, bool) else None
    if isinstance(count, int) and count > len(told):  # some untold: say how many in all
        more = f"; {count} markers in all" + (f", {_n(times)} times" if times else "")
    else:  # every marker told: only how often, where more than once each
        more = f" ({_n(times)} times)" if times and times > len(told) else ""
    return ["; ".join(told) + more]


def _sizes(evidence: Mapping[str, Any], target: str | None = None) -> Iterable[str]:
    sent, reported = evidence.get("prompt_tokens_sent"), evidence.get("prompt_tokens_reported")
    status = evidence.get("status_code")
    if sent is None and reported is None:
        dropped = [d for d in evidence.get("dropped_prompts") or [] if isinstance(d, dict)]
        if not dropped:
            return []
        first = dropped[0]
        sent, reported, status = (
            first.get("prompt_tokens_sent") or f"{first.get('prompt_bytes', '?')} bytes",
            first.get("prompt_tokens_reported"),
            first.get("status_code"),
        )
    answered = f"HTTP {status}: " if status is not None else ""
    told = f"prompt of {_n(sent)} tokens sent" if sent is not None else "prompt of unknown size sent"
    # A refusal reports no count: "None reported" read as a figure.
    engine = f"{_n(reported)} reported by the engine" if reported is not None else "no count from the engine"
    return [f"{answered}{told}, {engine}"]


def _capacity(evidence: Mapping[str, Any], target: str | None) -> Iterable[str]:
    capacity = evidence.get("capacity")
    facts = capacity if isinstance(capacity, dict) else evidence
    window = facts.get("context_window")
    stated = facts.get("pools")
    pools: Mapping[str, Any] = stated if isinstance(stated, dict) else {}
    pool = facts.get("kv_pool_tokens")
    if window is None and not pools and pool is None:
        return []
    held = ", ".join(f"{name} {_n(size)}" for name, size in pools.items()) or (
        _n(pool) if pool is not None else "unknown"
    )
    pooled = f"KV pool{'s' if len(pools) > 1 else ''}: {held} tokens"
    return [pooled + (f"; context window {_n(window)} tokens" if window is not None else "")]


def _records(evidence: Mapping[str, Any], target: str | None) -> Iterable[str]:
    records = [r for r in evidence.get("records") or [] if isinstance(r, dict)]
    if not records:
        return []
    named = "; ".join(_record(r) for r in records[:MAX_RECORDS])
    flagged, gateway = evidence.get("flagged", len(records)), evidence.get("gateway")
    through = f" through gateway {gateway}" if gateway else ""
    return [f"{flagged} gateway record(s) failed{through}: {named}"]


def _record(r: Mapping[str, Any]) -> str:
    request = r.get("upstream_id") or r.get("request_id", "?")
    why = f" ({r['reason']})" if r.get("reason") else ""
    return f"request {request} of {r.get('caller') or 'an unnamed caller'}{why}"


def _path(evidence: Mapping[str, Any], target: str | None) -> Iterable[str]:
    path = evidence.get("path")
    if isinstance(path, dict) and {"prefill", "decode"} <= path.keys():
        return [f"sent down prefill {path['prefill']} → decode {path['decode']}"]
    return []


def _n(value: Any) -> str:
    """A count with thousands separated; anything else as it is."""
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


_TELLERS: tuple[Callable[[Mapping[str, Any], str | None], Iterable[str]], ...] = (
    _leaks, _records, _sizes, _capacity, _path,
)  # fmt: skip
