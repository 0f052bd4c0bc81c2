"""The trigger kinds against a real llama-cpp-python server (tiny random model): no false alarm.

The server (``--n_ctx 2048``, ``--interrupt_requests false``: its default cuts a running stream
when another request arrives, which every concurrent kind would read as broken streams) runs one
request at a time, so the kinds' concurrent steps queue behind its lock; it states no context size
(the target states it, as for the needle), takes no ``cache_salt`` (the salted step is left out
there), sends no usage in streams, and counts no aborts (the hang-up kind's count is not judged).
A random model repeats no nonce: every kind judges foreign and other requests' markers only, and
must find none in :data:`RUNS` runs each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvcanary.probes.base import ProbeResult, Verdict
from tests.support.engine_runs import repeated_runs
from tests.support.llamacpp import LlamaCppServer

pytestmark = pytest.mark.llamacpp

RUNS = 3
N_CTX = 2048
OPTIONS: dict[str, dict[str, Any]] = {
    "boundary": {"context_window": N_CTX},
    "session": {"churn_tokens": 2048},  # no pool is published: a stated burst
    "full_batch": {"size": 8},  # one request at a time: a batch only in name, kept short
}


def runs(server: LlamaCppServer, kind: str) -> list[ProbeResult]:
    return repeated_runs(server.url, "llamacpp", server.model_name, kind, RUNS, OPTIONS)


@pytest.mark.parametrize("kind", ["duplicate_ids", "shared_prefix", "hangup", "session", "full_batch"])
def test_a_trigger_kind_raises_no_false_alarm_on_llamacpp(
    llamacpp_servers: Callable[..., LlamaCppServer], kind: str
) -> None:
    results = runs(llamacpp_servers(n_ctx=N_CTX, interrupt_requests=False), kind)
    said = [(r.verdict, r.reason, r.detail[:300]) for r in results]
    assert [(r.verdict, r.reason) for r in results] == [(Verdict.PASS, "no_foreign_marker")] * RUNS, said
    assert all(r.evidence["judged"] == "foreign_markers_only" for r in results)
    if kind == "hangup":
        assert all(r.evidence["aborts_counted"] is None for r in results)
    if kind == "shared_prefix":
        assert all(t["step"] != "salted" for r in results for t in r.evidence["tenants"])
