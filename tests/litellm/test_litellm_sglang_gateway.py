"""Customers' traffic through LiteLLM, then SGLang's model gateway, then reference PD servers, judged
as the tap's traffic is judged everywhere else.

Every part is a real process on loopback: one prefill server with the incident's small KV pool
(1,024 tokens under an 8,192-token window) and the placeholder defect, two decode servers,
``sglang-router`` 0.3.2 in ``--pd-disaggregation`` mode in front of them, a LiteLLM proxy with the
kvcanary tap whose model's ``api_base`` is the gateway, and ``kvcanary serve`` with one target whose
``base_url`` is the gateway and whose ``sglang_router`` names it (so its nodes are found there).

Three customers send short questions, streamed and not; a fourth sends prompts over the prefill
pool, which the defect answers 200 from stale decode pages with ``usage.prompt_tokens = 1``. The
traffic is sent once for the module; each test reads one side of how it was judged, and the
figures (records sent, judged, flagged, false flags, seconds to judgement) are printed.

Needs both venvs (``tests/litellm/conftest.py``, ``tests/workers/test_pd_gateway.py``): skipped
without the gateway's unless ``KVCANARY_REQUIRE_SGLANG_ROUTER=1``, without LiteLLM's unless
``KVCANARY_REQUIRE_LITELLM=1``.
"""

from __future__ import annotations

import os
import random
import sqlite3
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from openai import OpenAI

from kvcanary.processes import stop_processes
from kvcanary.wire import PARTITIONS, api_base_key, partition_of
from tests.litellm.test_tap_litellm import (
    ask,
    client_of,
    customer_sentence,
    tap_env,
    wait_calibrated,
    with_ingest_token,
)
from tests.monitor.served import Served, reference_target
from tests.probes.probe_harness import KEYS
from tests.support import WorkerProcess
from tests.support.litellm import CALLERS, Proxy, start_proxy
from tests.workers.pd_support import PrefillServer, start_servers, stop_servers
from tests.workers.test_pd_gateway import ROUTER_PYTHON, Gateway, start_gateway
from tests.workers.test_pd_gateway import VENV as ROUTER_VENV

pytestmark = pytest.mark.external_service

TARGET = "pd-shop"
MODEL = "shop"
#: The caller whose prompts are over the prefill pool: the defect's trigger, told apart by its team.
LONG_KEY = "sk-umbrella-0004"
LONG_CALLER = "umbrella"
EVERY_CALLER = {**CALLERS, LONG_KEY: (LONG_CALLER, "umbrella-reports")}
#: Keys every server knows: LiteLLM's (``api_key: gateway`` in its config) and the monitor's tenants'.
SERVER_KEYS = (
    "--api-key", "gateway=litellm",
    *(flag for tenant, key in KEYS.items() for flag in ("--api-key", f"{key}={tenant}")),
)  # fmt: skip
ROUNDS = 4
SMALL_POOL = 1024


@dataclass
class Sent:
    """What the customers sent and got: answers by caller, the over-pool ones' reported usage."""

    answered: Counter[str] = field(default_factory=Counter)
    over_pool_prompt_tokens: list[int] = field(default_factory=list)
    over_pool_chars: list[int] = field(default_factory=list)
    last_answer_at: float = 0.0

    @property
    def total(self) -> int:
        return self.answered.total()

    @property
    def benign(self) -> int:
        return self.total - self.answered[LONG_CALLER]


@dataclass
class Stack:
    prefill: PrefillServer
    decodes: dict[str, WorkerProcess]
    gateway: Gateway
    monitor: Served
    proxy: Proxy
    sent: Sent
    judged_after: float


def need_router() -> None:
    if not (ROUTER_PYTHON.exists() and (ROUTER_VENV / ".kvcanary-setup").exists()):
        message = f"no sglang-router venv at {ROUTER_VENV}: run bash scripts/setup-sglang-router.sh"
        if os.environ.get("KVCANARY_REQUIRE_SGLANG_ROUTER") == "1":
            pytest.fail(message)
        pytest.skip(message)


def monitor_config(gateway_url: str) -> dict[str, Any]:
    """One target: the gateway is its ``base_url`` and its ``sglang_router``. The canary, every two
    seconds, gives the judge its calibration (the tokenizer's characters per token); the capacity
    audit measures each node the gateway lists once, when it joins."""
    target = reference_target(
        TARGET,
        gateway_url,
        sglang_router=gateway_url,
        # Its servers take the tenants' keys and are the operator's own, on loopback.
        credential_hosts=["127.0.0.1"],
        discovery_interval_seconds=1.0,
        probes=["canary", "capacity"],
        interval_seconds=2.0,
        probe_intervals={"capacity": 3600},
    )
    return {
        "targets": [target],
        "traffic": {"pass_interval_seconds": 1},
        "scheduler": {"jitter_seconds": 0.1},
    }


def send_traffic(proxy: Proxy) -> Sent:
    """Each round: the three customers' questions (under the pool, streamed and not), then one
    prompt over the prefill pool, answered from the decode pages the questions freed."""
    rng = random.Random(35)
    sent = Sent()
    for round_ in range(ROUNDS):
        for i, key in enumerate(CALLERS):
            team = CALLERS[key][0]
            question = customer_sentence(rng, team, 40 + 10 * (round_ % 3))  # ~300 to 500 tokens
            ask(client_of(proxy, key), MODEL, [{"role": "user", "content": question}],
                stream=(i + round_) % 2 == 0, max_tokens=48)  # fmt: skip
            sent.answered[team] += 1
        report = " ".join(customer_sentence(rng, LONG_CALLER, 60) for _ in range(4))  # ~1,900 tokens
        reported = over_pool_request(client_of(proxy, LONG_KEY), report)
        sent.answered[LONG_CALLER] += 1
        sent.over_pool_prompt_tokens.append(reported)
        sent.over_pool_chars.append(len(report))
    sent.last_answer_at = time.monotonic()
    return sent


def over_pool_request(client: OpenAI, prompt: str) -> int:
    """Send a prompt over the prefill pool, not streamed; return the prompt tokens the answer reports."""
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=128, temperature=0
    )
    assert answer.usage is not None
    return answer.usage.prompt_tokens


def counted(monitor: Served) -> tuple[int, int]:
    """Return (records judged for the target, records no target matched): every judged record gets
    the marker check, whatever the others could judge."""
    judged = monitor.value("kvcanary_traffic_records_total", target=TARGET, check="marker") or 0
    unmatched = monitor.value("kvcanary_traffic_unmatched_records_total") or 0
    return int(judged), int(unmatched)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The whole path started, the traffic sent once and waited for until every record is counted
    (judged or unmatched)."""
    need_router()
    logs = tmp_path_factory.mktemp("litellm-sglang-gateway")
    prefills, decodes = start_servers(
        logs, {"small": ("placeholder", *SERVER_KEYS)}, {"d0": SERVER_KEYS, "d1": SERVER_KEYS}
    )
    gateway: Gateway | None = None
    monitor: Served | None = None
    proxy: Proxy | None = None
    try:
        gateway = start_gateway(logs, [prefills["small"]], list(decodes.values()))
        (logs / "monitor").mkdir()
        monitor = with_ingest_token(Served(logs / "monitor", monitor_config(gateway.url))).start()
        proxy = start_proxy(logs / "proxy", {MODEL: gateway.url}, tap_env(monitor), callers=EVERY_CALLER)
        wait_calibrated(monitor)
        monitor.wait_for("the prefill pool measured", lambda: measured_pools(monitor, prefills["small"]))
        sent = send_traffic(proxy)
        monitor.wait_for(
            f"{sent.total} records counted", lambda: sum(counted(monitor)) >= sent.total, timeout=90
        )
        judged_after = time.monotonic() - sent.last_answer_at
        ready = Stack(prefills["small"], decodes, gateway, monitor, proxy, sent, judged_after)
        print_figures(ready)
        yield ready
    finally:
        stop_processes([p.proc for p in (gateway, proxy) if p is not None])
        if monitor is not None:
            monitor.stop()
        stop_servers(prefills, decodes)


def node_name(role: str, url: str) -> str:
    """The name the monitor gives a node the gateway lists (``role-host-port``)."""
    return f"{role}-{url.removeprefix('http://').replace(':', '-')}"


def measured_pools(monitor: Served, prefill: PrefillServer) -> dict[str, float]:
    """The pools the capacity audit measured on the prefill node, by pool name."""
    node = node_name("prefill", prefill.url)
    return {
        labels["pool"]: value
        for labels, value in monitor.samples("kvcanary_node_kv_pool_tokens")
        if labels["target"] == TARGET and labels["node"] == node
    }


def kept(stack: Stack, **filters: str) -> list[dict[str, Any]]:
    """The monitor's kept records of the target (flagged, or near or over their node's pool)."""
    page = stack.monitor.get("/api/v1/traffic", target=TARGET, limit=500, **filters)
    assert page.status_code == 200, page.text
    return list(page.json()["items"])


def stored(stack: Stack, query: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(stack.monitor.tmp / "kvcanary.db") as db:
        return db.execute(query).fetchall()


def print_figures(stack: Stack) -> None:
    judged, unmatched = counted(stack.monitor)
    flagged = [r for r in kept(stack) if r["checks"]]
    false_flags = [r for r in flagged if r["caller"] != LONG_CALLER]
    by_check = Counter(check for r in flagged for check in r["checks"])
    print(
        f"\nLiteLLM -> sglang-router -> PD: sent {stack.sent.total} "
        f"({stack.sent.benign} benign, {stack.sent.total - stack.sent.benign} over the pool), "
        f"judged {judged}, unmatched {unmatched}, flagged {len(flagged)} {dict(by_check)}, "
        f"false flags {len(false_flags)}, judged {stack.judged_after:.1f} s after the last answer"
    )


def test_the_defect_answers_every_over_pool_prompt_200_as_one_token(stack: Stack) -> None:
    """The path reproduces the incident: the gateway's client got a 200 for each over-pool prompt,
    counted as one token (a placeholder was prefilled and the rest decoded over stale pages)."""
    assert stack.sent.over_pool_prompt_tokens == [1] * ROUNDS
    assert all(chars > SMALL_POOL for chars in stack.sent.over_pool_chars)


def test_every_record_is_judged_as_the_gateways_deployment(stack: Stack) -> None:
    """Each record names the gateway as its ``api_base``: none is unmatched, every one is counted for
    the target at its ``base_url`` (node ``""``, not a node the gateway listed), and each was judged
    once under the partition of the gateway's ``api_base``."""
    judged, unmatched = counted(stack.monitor)
    assert (judged, unmatched) == (stack.sent.total, 0)
    minutes = stored(
        stack,
        "SELECT t.name, m.node, m.caller, SUM(m.records) FROM traffic_minute m "
        "JOIN target t ON t.id = m.target_id GROUP BY t.name, m.node, m.caller",
    )
    assert {(name, node, caller): n for name, node, caller, n in minutes} == {
        (TARGET, "", caller): n for caller, n in stack.sent.answered.items()
    }
    gateway_api_base = f"{stack.gateway.url}/v1"  # what LiteLLM's config names
    assert api_base_key(gateway_api_base) == stack.gateway.url
    partitions = stored(stack, "SELECT partition, COUNT(*) FROM traffic_judged GROUP BY partition")
    assert partitions == [(partition_of(gateway_api_base, PARTITIONS), stack.sent.total)]
    assert all(r["gateway"] == "litellm-test" and r["node"] == "" for r in kept(stack))


def test_no_benign_request_is_flagged(stack: Stack) -> None:
    """The three customers' questions, under the pool and answered from their own pages, raise
    nothing in any check."""
    flagged = [r for r in kept(stack) if r["checks"] and r["caller"] != LONG_CALLER]
    assert flagged == []
    for verdict in ("leak", "mismatch"):
        for check in ("marker", "tokens", "capacity", "overlap"):
            found = stack.monitor.value(
                "kvcanary_traffic_records_total", target=TARGET, check=check, verdict=verdict
            )
            assert (found or 0) <= stack.sent.total - stack.sent.benign, (check, verdict)


def test_the_monitor_measured_the_small_prefill_pool_of_a_node_the_gateway_lists(stack: Stack) -> None:
    """The deployment's smallest pool is known to the monitor: the prefill node, found from the
    gateway, was audited at the 1,024 tokens it states itself."""
    stated = httpx.get(f"{stack.prefill.url}/get_server_info", timeout=10).json()["max_total_num_tokens"]
    assert stated == SMALL_POOL
    assert measured_pools(stack.monitor, stack.prefill) == {"prefill": SMALL_POOL}


def test_over_pool_answers_are_flagged_by_the_capacity_check_with_the_prefill_pool(stack: Stack) -> None:
    """Each over-pool answer is a capacity ``mismatch`` judged against the deployment's smallest pool,
    the prefill node's 1,024 tokens; each benign record passes the check."""
    capacity = kept(stack, check="capacity")
    assert sorted(r["caller"] for r in capacity) == [LONG_CALLER] * ROUNDS
    assert all(r["status_code"] == 200 and r["prompt_tokens"] == 1 for r in capacity)
    assert all(r["kv_pool_tokens"] == SMALL_POOL < r["estimated_prompt_tokens"] for r in capacity)
    passed = stack.monitor.value(
        "kvcanary_traffic_records_total", target=TARGET, check="capacity", verdict="pass"
    )
    assert passed == stack.sent.benign


def test_over_pool_answers_are_flagged_by_the_tokens_check(stack: Stack) -> None:
    """One token reported for a prompt of ~1,900 characters is impossible at the tokenizer's density."""
    tokens = kept(stack, check="tokens")
    assert sorted(r["caller"] for r in tokens) == [LONG_CALLER] * ROUNDS
