"""Data-parallel ranks behind SGLang's model gateway, each probed as a path of its own.

One prefill server with two ranks (``--dp-size 2``) and the incident's defect: rank 0's pool holds
twice the window, rank 1's is the incident's small one, as when one GPU had less memory free. One
decode server with two ranks. The real gateway (sglang-router 0.3.2, PD mode, not ``--dp-aware``:
in 0.3.2 that flag sends PD requests to the literal ``URL@rank``, fixed by sglang#26245) lists each
server once; its random rooms spread requests over the prefill ranks, so a probe through it meets
the small rank one time in two, and a health check that always sends room 0 never does
(dynamo#6004).

``kvcanary serve``, given only the gateway's URL, reads each found node's ``dp_size`` and probes the
four rank pairs itself (the room picks the prefill rank, ``routed_dp_rank`` names each side's):
the two paths through prefill rank 1 leak and are named, the two through rank 0 pass, and each rank
pair is a series of ``kvcanary_path_last_judged_timestamp``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from kvcanary.monitor.config.targets import path_name
from kvcanary.processes import stop_processes
from tests.monitor.runs.test_gateway_paths import TENANT_KEYS, Fleet, last_results, node, verdicts, watch
from tests.monitor.served import Served
from tests.workers.pd_support import start_servers, stop_servers


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from tests.workers.test_pd_gateway import need_router

    need_router()
    logs = tmp_path_factory.mktemp("gateway-dp")
    ranks = ("--dp-size", "2")
    prefills, decodes = start_servers(
        logs,
        {"ranked": ("placeholder", *ranks, "--rank-pool-tokens", "0=16384", *TENANT_KEYS)},
        {"ranked": (*ranks, *TENANT_KEYS)},
    )
    try:
        yield Fleet(prefills, decodes, logs)
    finally:
        stop_servers(prefills, decodes)


def test_each_rank_pair_is_probed_and_the_small_ranks_paths_are_named(
    fleet: Fleet, served: Callable[..., Served]
) -> None:
    from tests.workers.test_pd_gateway import start_gateway

    gateway = start_gateway(fleet.logs, list(fleet.prefills.values()), list(fleet.decodes.values()))
    try:
        began = time.monotonic()
        monitor = watch(served, gateway.url)
        prefill = node("prefill", fleet.prefills["ranked"].url)
        decode = node("decode", fleet.decodes["ranked"].url)
        paths = {(p, d): path_name(f"{prefill}.dp{p}", f"{decode}.dp{d}") for p in (0, 1) for d in (0, 1)}

        def all_judged() -> dict[tuple[int, int], dict[str, str]] | None:
            seen = {pair: verdicts(monitor, name) for pair, name in paths.items()}
            return seen if all(set(v) == {"canary", "boundary"} for v in seen.values()) else None

        seen = monitor.wait_for("both kinds run down each of the four rank pairs", all_judged, timeout=90)
        print(f"the four rank pairs judged {time.monotonic() - began:.1f}s after the monitor started")
        for d in (0, 1):
            assert seen[(1, d)]["boundary"] in ("leak", "mismatch"), seen
            rows = last_results(monitor, paths[(0, d)])
            why = [(r["probe"], r["reason"], r["detail"]) for r in rows]
            assert seen[(0, d)] == {"canary": "pass", "boundary": "pass"}, why

        incidents = monitor.get("/api/v1/incidents", target="glm", state="open").json()["items"]
        named = {i["node"] for i in incidents if i["probe"] == "boundary"}
        assert named == {paths[(1, 0)], paths[(1, 1)]}, incidents
        evidence = [r["evidence"] for r in last_results(monitor, paths[(1, 1)])
                    if r["probe"] == "boundary" and r["verdict"] != "pass"]  # fmt: skip
        assert evidence and evidence[0]["path"] == {"prefill": f"{prefill}.dp1", "decode": f"{decode}.dp1"}

        samples = monitor.samples("kvcanary_path_last_judged_timestamp")
        judged = {(labels["prefill"], labels["decode"]) for labels, _ in samples}
        assert judged == {(f"{prefill}.dp{p}", f"{decode}.dp{d}") for p in (0, 1) for d in (0, 1)}
    finally:
        stop_processes([gateway.proc])
