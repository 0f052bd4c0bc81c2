"""Customer traffic through a real LiteLLM proxy onto NATS JetStream, judged by two ``kvcanary
serve`` replicas on PostgreSQL, across the three restarts an operator lives through.

The proxy's tap publishes to the machine's NATS (a stream of this test's own); the replicas share
its partitions. Customers send requests without pause while

- (a) every monitor is killed (SIGKILL) for a minute: the records wait in the stream;
- (b) the gateway is restarted (SIGTERM, then started again on its port): the tap flushes what it
  still holds at exit;
- (c) the replica holding the deployment's partition is killed: the other takes the partition over
  and the records the dead one took unacknowledged are delivered again.

In each phase one caller of its own sends prompts over the defective worker's 1,024-token pool,
answered 200 from stale pages: the leak. Every response the gateway gave must be judged exactly
once (the minute counts and the judged ids both equal what the customers received), each phase's
leaks flagged by the capacity check, and all of them in the blast radius of the open incident.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from openai import APIConnectionError, APIStatusError, OpenAI

from kvcanary.monitor.storage.db import make_engine, make_session_factory
from kvcanary.processes import wait_until
from kvcanary.tap.jetstream import partition_of
from tests.litellm.test_blast_radius_litellm import DEFECTIVE, by_caller
from tests.litellm.test_tap_litellm import ask, client_of, customer_sentence, wait_calibrated
from tests.monitor.served import Served, reference_target
from tests.support import WorkerProcess, own_database, stop_process
from tests.support.jetstream import NATS_URL, StreamNames, counted, stream_report
from tests.support.litellm import CALLERS, Proxy, start_proxy

pytestmark = pytest.mark.external_service

#: One caller per phase sends that phase's leaks, so each is told apart in every count.
LEAKERS = {f"sk-leak-{p}-0100": (f"leak-{p}", f"leak-{p}-key") for p in "abc"}
LEAKS_PER_PHASE = 2
OUTAGE_SECONDS = 60.0
ACK_WAIT_SECONDS = 3


class Customers(threading.Thread):
    """The three customers' requests, one after another until stopped (none over the pool):
    what the gateway answered, by caller; a request the gateway never took (it was down) is
    tried again after a moment and not counted."""

    def __init__(self, proxy_url: str):
        super().__init__(name="customers", daemon=True)
        self.proxy_url = proxy_url
        self.answered: Counter[str] = Counter()
        self.refused = 0
        self.failures: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        rng = random.Random(26)
        keys = list(CALLERS)
        i = 0
        while not self._halt.is_set():
            key = keys[i % len(keys)]
            team = CALLERS[key][0]
            client = OpenAI(base_url=f"{self.proxy_url}/v1", api_key=key, max_retries=0, timeout=60)
            try:
                ask(client, "shop", [{"role": "user", "content": customer_sentence(rng, team, 40)}],
                    stream=i % 2 == 0, max_tokens=16)  # fmt: skip
                self.answered[team] += 1
            except APIStatusError as exc:  # the gateway answered: a record all the same
                self.answered[team] += 1
                self.failures.append(f"{team}: {exc.status_code}")
            except APIConnectionError:
                self.refused += 1
                time.sleep(0.2)
            i += 1
            time.sleep(0.05)

    def stop(self) -> None:
        self._halt.set()
        self.join(90)


def leak(proxy: Proxy, key: str, rng: random.Random) -> None:
    """Over-pool prompts of the phase's caller: answered 200 by the defective worker."""
    team = LEAKERS[key][0]
    for _ in range(LEAKS_PER_PHASE):
        over = " ".join(customer_sentence(rng, team, 60) for _ in range(6))  # ~2,300 bytes: tokens
        ask(client_of(proxy, key), "shop", [{"role": "user", "content": over}], stream=False, max_tokens=32)


@pytest.fixture
def database_url(postgres_url: str) -> Iterator[str]:
    yield from own_database("kvcanary_jsgw")


def kill(monitor: Served) -> None:
    assert monitor.proc is not None
    os.killpg(monitor.proc.pid, signal.SIGKILL)
    monitor.proc.wait(10)
    monitor.proc = None


def test_through_litellm_every_response_is_judged_once_across_monitor_gateway_and_replica_restarts(
    tmp_path: Path,
    start_worker: Callable[..., WorkerProcess],
    served: Callable[..., Served],
    stream_names: StreamNames,
    database_url: str,
) -> None:
    worker = start_worker(*DEFECTIVE)
    config = {
        "database_url": database_url,
        "targets": [reference_target("shared", worker.url, probes=["canary"], interval_seconds=1.0)],
        "traffic": {
            "source": "jetstream",
            "pass_interval_seconds": 1,
            "jetstream": stream_names.config(ack_wait_seconds=ACK_WAIT_SECONDS, duplicate_window_seconds=300),
        },
        # One incident across the phases: its blast radius holds every phase's leaks.
        "incidents": {"resolve_after_passes": 100_000},
    }
    replicas = [served(config).start(), served(config)]
    replicas[1].start(migrate=False)
    wait_calibrated(replicas[0])
    tap_env = {
        "KVCANARY_TAP_URL": NATS_URL,
        "KVCANARY_TAP_SUBJECT_PREFIX": stream_names.subject_prefix,
        "KVCANARY_TAP_KEY": "a-fingerprint-key-the-monitor-never-sees",
        "KVCANARY_TAP_GATEWAY": "litellm-js",
        "KVCANARY_TAP_FLUSH_SECONDS": "0.5",
    }
    folder = tmp_path / "gateway"
    proxy = start_proxy(folder, {"shop": worker.url}, tap_env, callers={**CALLERS, **LEAKERS})
    factory = make_session_factory(engine := make_engine(database_url))
    customers = Customers(proxy.url)
    rng = random.Random(2026)
    leaked: Counter[str] = Counter()

    def sent() -> int:
        return sum(customers.answered.values()) + sum(leaked.values())

    def state() -> str:
        reports = "\n".join(f"{m.url}: {stream_report(m)}" for m in replicas if m.proc is not None)
        return f"{reports}\nsent {sent()}, counted {counted(factory)}, refused {customers.refused}"

    def leak_phase(phase: str) -> None:
        key = f"sk-leak-{phase}-0100"
        leak(proxy, key, rng)
        leaked[LEAKERS[key][0]] += LEAKS_PER_PHASE

    try:
        customers.start()
        wait_until("records judged through the stream", lambda: counted(factory)[0] >= 10, timeout=60,
                   state=state)  # fmt: skip

        # (a) Every monitor down for a minute; the gateway and the stream go on.
        down_at = time.monotonic()
        for monitor in replicas:
            kill(monitor)
        leak_phase("a")
        time.sleep(max(0.0, down_at + OUTAGE_SECONDS - time.monotonic()))
        waited = sent()
        replicas[0].start(migrate=False)
        replicas[1].start(migrate=False)
        wait_until("the minute's backlog judged", lambda: counted(factory)[0] >= waited, timeout=90,
                   state=state)  # fmt: skip

        # (b) The gateway restarted mid-traffic: what its tap still held goes out as it exits.
        leak_phase("b")
        proxy.proc.send_signal(signal.SIGTERM)
        # LiteLLM (like uvicorn under it) raises SIGTERM again once it has shut down gracefully.
        assert proxy.proc.wait(60) in (0, -signal.SIGTERM), proxy.output()[-3000:]
        assert "not sent at exit" not in proxy.output() and "Traceback" not in proxy.output()
        proxy = start_proxy(folder, {"shop": worker.url}, tap_env, callers={**CALLERS, **LEAKERS},
                            port=int(proxy.url.rsplit(":", 1)[1]))  # fmt: skip
        answered = sum(customers.answered.values())
        wait_until("customers answered again", lambda: sum(customers.answered.values()) > answered + 5,
                   timeout=60, state=state)  # fmt: skip

        # (c) The replica that holds the deployment's partition killed while it judges.
        partition = partition_of(f"{worker.url}/v1", 16)
        holder = wait_until(
            "a replica to hold the deployment's partition",
            lambda: next((m for m in replicas if partition in stream_report(m).get("partitions", [])), None),
            state=state,
        )
        survivor = replicas[1 - replicas.index(holder)]
        leak_phase("c")
        kill(holder)
        time.sleep(ACK_WAIT_SECONDS + 2)  # traffic goes on while the partition moves
        customers.stop()
        assert not customers.is_alive()

        total = sent()
        wait_until("every response judged", lambda: counted(factory)[0] >= total, timeout=90, state=state)
        time.sleep(2 * ACK_WAIT_SECONDS + 2)  # a record judged twice would land meanwhile
        assert counted(factory) == (total, total), state()
        assert customers.refused > 0 and not customers.failures, (customers.refused, customers.failures)

        flagged = survivor.get("/api/v1/traffic", target="shared", check="capacity", limit=100).json()[
            "items"
        ]
        assert Counter(r["caller"] for r in flagged) == leaked, flagged
        incidents = survivor.get("/api/v1/incidents", probe="traffic_capacity", state="open").json()["items"]
        assert len(incidents) == 1, incidents
        radius = survivor.get(f"/api/v1/incidents/{incidents[0]['id']}/blast-radius").json()
        assert by_caller(radius) == dict(leaked), radius
    finally:
        if customers.is_alive():
            customers.stop()
        stop_process(proxy.proc)
        engine.dispose()
