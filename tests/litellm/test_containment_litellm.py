"""Containment end to end: ``kvcanary serve`` finds a leak, and a real LiteLLM proxy with
the tap stops sending customers to the leaking deployment within 2 s of the verdict.

Two reference workers are the two deployments of one model group: ``glm`` has the incident's
defect (a prefill pool below the window, the placeholder admission), ``calm`` is sound. The monitor
probes both (``boundary`` every 2 s) under ``containment.mode: quarantine``; three customers ask
through the proxy without pause. After the first leak verdict no answer from ``glm`` reaches a
customer later than 2 s after it, every request keeps succeeding on ``calm``, and once an operator
lifts the quarantine ``glm`` serves again. The same with the traffic on NATS JetStream and two of
everything: two ``kvcanary serve`` replicas on PostgreSQL putting the set in the JetStream KV
bucket, two gateway replicas watching it. And a rogue writer to that bucket, whose forged sets move
no gateway for a moment while operators' changes still reach every tap within 2 s. The gateway's
side alone, against a loopback set: ``test_quarantine_litellm.py``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from kvcanary.monitor.containment.bucket import RECHECK_SECONDS
from kvcanary.monitor.storage.db import make_engine, make_session_factory
from kvcanary.tap.containment.bucket import BucketWatch
from tests.litellm.test_quarantine_litellm import ask, entry, key_of, start_gateway
from tests.monitor.served import Served, reference_target
from tests.support import (
    REPO,
    WorkerProcess,
    launch_worker,
    own_database,
    stop_process,
    wait_http,
    wait_worker,
)
from tests.support.jetstream import NATS_URL, StreamNames, counted
from tests.support.litellm import Proxy
from tests.support.services import start_prometheus
from tests.support.signing import SigningKeys, make_keys
from tests.support.signing import document as signing_document
from tests.tap.containment.test_forged import Rogue, Sampler, held

POOL = ["--mode", "disaggregated", "--context-window", "8192", "--decode-pool-tokens", "16384"]
POOL += ["--page-size", "16"]
DEFECTIVE = [*POOL, "--prefill-pool-tokens", "1024", "--admission", "placeholder"]
SOUND = [*POOL, "--prefill-pool-tokens", "16384", "--admission", "reject"]
INGEST = "containment-test-ingest-token-0123456789"
CONTAINMENT_SECONDS = 2.0
RULES = REPO / "alerts" / "kvcanary.rules.yml"

pytestmark = pytest.mark.external_service


class Answer(NamedTuple):
    """One customer's request: when it was sent and when its answer ended (wall clock), its status
    and the deployment that served it. The gateway routes a request when it comes: one routed before
    the quarantine set was taken up may end after the bound on a loaded machine."""

    sent: float
    finished: float
    status: int
    api_base: str


@dataclass
class Customers:
    """Three callers asking through the proxy without pause."""

    proxy: Proxy
    answers: list[Answer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Customers:
        def caller() -> None:
            with httpx.Client(timeout=30) as client:
                while not self._stop.is_set():
                    sent = time.time()
                    answer = ask(self.proxy, client)
                    self.answers.append(Answer(sent, time.time(), answer.status, answer.api_base))

        self._threads = [threading.Thread(target=caller, daemon=True) for _ in range(3)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)


@dataclass
class Stack:
    monitor: Served
    proxy: Proxy
    leaking: WorkerProcess
    sound: WorkerProcess


@pytest.fixture
def stack(served: Callable[..., Served], tmp_path: Path) -> Iterator[Stack]:
    """The workers and the gateway, running; the monitor made but not started (the test starts it
    once customers are served, so that the leak comes while they are)."""
    leaking, sound = launch_worker(DEFECTIVE, tmp_path), launch_worker(SOUND, tmp_path)
    keys = make_keys(tmp_path / "keys")
    proxy = None
    try:
        wait_worker(leaking), wait_worker(sound)
        probes = {"probes": ["boundary"], "probe_intervals": {"boundary": 2.0}, "timeout_seconds": 15}
        targets = [
            reference_target("glm", leaking.url, **probes),
            reference_target("calm", sound.url, **probes),
        ]
        monitor = served({
            "targets": targets,
            "containment": {"mode": "quarantine"},
            "containment_signing": keys.monitor_config(),
            "scheduler": {"jitter_seconds": 0.1},
            "traffic": {"ingest_token_env": "KVC_TEST_INGEST"},
        })  # fmt: skip
        monitor.env["KVC_TEST_INGEST"] = INGEST
        env = {
            "KVCANARY_TAP_URL": monitor.url,
            "KVCANARY_TAP_TOKEN": INGEST,
            "KVCANARY_TAP_GATEWAY": "gw-e2e",
            "KVCANARY_TAP_KEY": "a-fingerprint-key-the-monitor-never-sees",
            "KVCANARY_TAP_QUARANTINE": "1",
            **keys.tap_env(),
            # Half the default poll: the 2 s promise holds with margin on a loaded 2-core host too.
            "KVCANARY_TAP_QUARANTINE_POLL_SECONDS": "0.5",
        }
        proxy = start_gateway(tmp_path / "gateway", [leaking, sound], env)
        yield Stack(monitor, proxy, leaking, sound)
    finally:
        for proc in [*([proxy.proc] if proxy else []), leaking.proc, sound.proc]:
            stop_process(proc)


def first_leak(monitor: Served) -> float | None:
    """When the first leak verdict on glm was reached (its run's end, wall clock), or None."""
    rows = monitor.get("/api/v1/probe-results", target="glm", verdict="leak").json()["items"]
    if not rows:
        return None
    first = rows[-1]
    return datetime.fromisoformat(first["started_at"]).timestamp() + float(first["duration_seconds"])


def test_no_customer_gets_an_answer_from_the_leaking_deployment_two_seconds_after_the_verdict(
    stack: Stack,
) -> None:
    leaking, sound = key_of(stack.leaking), key_of(stack.sound)
    customers = Customers(stack.proxy).start()
    try:
        wait_served = lambda: {a.api_base for a in customers.answers} == {leaking, sound}  # noqa: E731
        stack.monitor.wait_for("both deployments to serve customers", wait_served, 60)
        stack.monitor.start()
        verdict_at = stack.monitor.wait_for("the first leak verdict", lambda: first_leak(stack.monitor), 90)
        time.sleep(CONTAINMENT_SECONDS + 3)
    finally:
        customers.stop()
    answers = list(customers.answers)
    before = [a for a in answers if a.finished < verdict_at]
    assert {a.api_base for a in before} == {leaking, sound}, "both deployments served before the leak"
    from_leaking = [a for a in answers if a.api_base == leaking]
    last = max(a.finished for a in from_leaking) - verdict_at
    last_asked = max(a.sent for a in from_leaking) - verdict_at
    print(f"\nthe last answer from the leaking deployment came {last:.2f}s after the verdict, "
          f"to a request sent {last_asked:.2f}s after it")  # fmt: skip
    assert last_asked < CONTAINMENT_SECONDS
    after = [a for a in answers if a.sent > verdict_at + CONTAINMENT_SECONDS]
    assert len(after) >= 10 and {(a.status, a.api_base) for a in after} == {(200, sound)}

    lifted = httpx.delete(
        f"{stack.monitor.url}/api/v1/targets/glm/quarantine",
        params={"reason": "fixed: placeholder admission off"},
        headers={"Authorization": f"Bearer {stack.monitor.token}"},
    )
    assert lifted.status_code == 200, lifted.text
    lifted_at = time.time()
    again = Customers(stack.proxy).start()
    try:
        stack.monitor.wait_for(
            "the leaking deployment to serve again",
            lambda: any(a.api_base == leaking for a in again.answers),
            timeout=15,
        )
    finally:
        again.stop()
    back = min(a.finished for a in again.answers if a.api_base == leaking) - lifted_at
    print(f"traffic returned {back:.2f}s after the lift")
    assert {a.status for a in again.answers} == {200}


def lift(monitor: Served) -> None:
    lifted = httpx.delete(
        f"{monitor.url}/api/v1/targets/glm/quarantine",
        params={"reason": "fixed: placeholder admission off"},
        headers={"Authorization": f"Bearer {monitor.token}"},
    )
    assert lifted.status_code == 200, lifted.text


@pytest.fixture
def database_url(postgres_url: str) -> Iterator[str]:
    yield from own_database("kvcanary_containjs")


def test_over_jetstream_every_gateway_replica_watching_the_bucket_stops_within_two_seconds(
    served: Callable[..., Served], tmp_path: Path, stream_names: StreamNames, database_url: str
) -> None:
    leaking, sound = launch_worker(DEFECTIVE, tmp_path), launch_worker(SOUND, tmp_path)
    keys = make_keys(tmp_path / "keys")
    proxies: list[Proxy] = []
    try:
        wait_worker(leaking), wait_worker(sound)
        probes = {"probes": ["boundary"], "probe_intervals": {"boundary": 2.0}, "timeout_seconds": 15}
        config = {
            "database_url": database_url,
            "targets": [reference_target(n, w.url, **probes) for n, w in (("glm", leaking), ("calm", sound))],
            "containment": {"mode": "quarantine"},
            "containment_signing": keys.monitor_config(),
            "scheduler": {"jitter_seconds": 0.1},
            "traffic": {"source": "jetstream", "ingest_token_env": "KVC_TEST_INGEST",
                        "jetstream": stream_names.config(ack_wait_seconds=3, duplicate_window_seconds=30)},
        }  # fmt: skip
        replicas = [served(config), served(config)]
        for replica in replicas:
            replica.env["KVC_TEST_INGEST"] = INGEST
        for i in range(2):
            env = {
                "KVCANARY_TAP_URL": NATS_URL,
                "KVCANARY_TAP_SUBJECT_PREFIX": stream_names.subject_prefix,
                "KVCANARY_TAP_GATEWAY": f"gw-{i}",
                "KVCANARY_TAP_KEY": "a-fingerprint-key-the-monitor-never-sees",
                "KVCANARY_TAP_FLUSH_SECONDS": "0.5",
                # The set is watched in the monitors' bucket: no gateway asks a monitor replica.
                "KVCANARY_TAP_QUARANTINE": "1",
                "KVCANARY_TAP_QUARANTINE_BUCKET": stream_names.quarantine_bucket,
                **keys.tap_env(),
            }
            proxies.append(start_gateway(tmp_path / f"gateway-{i}", [leaking, sound], env))
        customers = [Customers(proxy).start() for proxy in proxies]
        both = {key_of(leaking), key_of(sound)}
        served_both = lambda: all({a.api_base for a in c.answers} == both for c in customers)  # noqa: E731
        replicas[0].wait_for("both deployments to serve both gateways' customers", served_both, 60)
        replicas[0].migrate()
        for replica in replicas:  # started side by side, so that both answer about when one can judge
            replica.start(migrate=False, wait=False)
        for replica in replicas:
            wait_http(replica.url + "/healthz", timeout=60, proc=replica.proc)
        # Measured from the verdict, or from when both replicas answer if that is later (the rules
        # run once a replica serves).
        up_at = time.time()
        verdict_at = replicas[0].wait_for("the first leak verdict", lambda: first_leak(replicas[0]), 90)
        since = max(verdict_at, up_at)
        time.sleep(CONTAINMENT_SECONDS + 3)
        for c in customers:
            c.stop()
        for i, c in enumerate(customers):
            from_leaking = [a for a in c.answers if a.api_base == key_of(leaking)]
            last = max(a.finished for a in from_leaking) - since
            last_asked = max(a.sent for a in from_leaking) - since
            lag = verdict_at - up_at
            print(f"\ngateway {i}: the last answer from the leaking deployment {last:.2f}s after the later "
                  f"of the verdict and both replicas up, to a request sent {last_asked:.2f}s after it "
                  f"(the verdict {lag:+.2f}s after them)")  # fmt: skip
            assert last_asked < CONTAINMENT_SECONDS
            after = {(a.status, a.api_base) for a in c.answers if a.sent > since + CONTAINMENT_SECONDS}
            assert after == {(200, key_of(sound))}, after
        factory = make_session_factory(make_engine(database_url))
        judged = replicas[0].wait_for("the customers' records judged from the stream",
                                      lambda: counted(factory)[0] or None, timeout=30)  # fmt: skip
        assert judged > 0

        lift(replicas[1])  # lifted through the other replica: both gateways take it up
        again = [Customers(proxy).start() for proxy in proxies]
        try:
            served_again = lambda: all(  # noqa: E731
                any(a.api_base == key_of(leaking) for a in c.answers) for c in again
            )
            what = "the leaking deployment to serve again through each gateway"
            replicas[0].wait_for(what, served_again, 15)
        finally:
            for c in again:
                c.stop()
    finally:
        for proc in [*(p.proc for p in proxies), leaking.proc, sound.proc]:
            stop_process(proc)


@dataclass
class ForgedStack:
    """Two replicas putting the signed set in the bucket, a real LiteLLM proxy watching it, a tap of
    this process watching it too (``sampled``), and a Prometheus with the rules scraping the replicas."""

    replicas: list[Served]
    proxy: Proxy
    sampled: BucketWatch
    prometheus: Any
    glm: WorkerProcess
    calm: WorkerProcess
    bucket: str


@pytest.fixture
def forged_stack(
    served: Callable[..., Served], tmp_path: Path, stream_names: StreamNames, database_url: str
) -> Iterator[ForgedStack]:
    glm, calm = launch_worker(SOUND, tmp_path), launch_worker(SOUND, tmp_path)
    keys = make_keys(tmp_path / "keys")
    proxy, sampled, prometheus = None, None, None
    try:
        wait_worker(glm), wait_worker(calm)
        idle = {"probes": ["canary"], "probe_intervals": {"canary": 3600.0}}
        jetstream = stream_names.config(ack_wait_seconds=3, duplicate_window_seconds=30)
        config = {
            "database_url": database_url,
            "targets": [reference_target(n, w.url, **idle) for n, w in (("glm", glm), ("calm", calm))],
            "containment": {"mode": "quarantine"},
            "containment_signing": keys.monitor_config(),
            "traffic": {"source": "jetstream", "ingest_token_env": "KVC_TEST_INGEST", "jetstream": jetstream},
        }
        replicas = [served(config), served(config)]
        for replica in replicas:
            replica.env["KVC_TEST_INGEST"] = INGEST
        replicas[0].migrate()
        for replica in replicas:
            replica.start(migrate=False)
        env = {
            "KVCANARY_TAP_URL": NATS_URL,
            "KVCANARY_TAP_SUBJECT_PREFIX": stream_names.subject_prefix,
            "KVCANARY_TAP_GATEWAY": "gw-litellm",
            "KVCANARY_TAP_KEY": "a-fingerprint-key-the-monitor-never-sees",
            "KVCANARY_TAP_QUARANTINE": "1",
            "KVCANARY_TAP_QUARANTINE_BUCKET": stream_names.quarantine_bucket,
            **keys.tap_env(),
        }
        proxy = start_gateway(tmp_path / "gateway", [glm, calm], env)
        sampled = BucketWatch(NATS_URL, bucket=stream_names.quarantine_bucket, keys=keys.public_keys,
                              gateway="gw-sampled", poll_seconds=0.2)  # fmt: skip
        scraped = {"kvcanary": [r.url.removeprefix("http://") for r in replicas]}
        prometheus = start_prometheus(tmp_path / "prometheus", scraped, rule_files=[RULES])
        yield ForgedStack(replicas, proxy, sampled, prometheus, glm, calm, stream_names.quarantine_bucket)
    finally:
        if sampled is not None:
            sampled.close()
        if prometheus is not None:
            prometheus.stop()
        for proc in [*([proxy.proc] if proxy else []), glm.proc, calm.proc]:
            stop_process(proc)


def by_hand(method: str, target: str, replica: Served) -> float:
    """Quarantine (POST) or lift (DELETE) ``target`` by hand through ``replica``; return when."""
    answer = httpx.request(
        method, f"{replica.url}/api/v1/targets/{target}/quarantine",
        json={"reason": "by hand"} if method == "POST" else None,
        headers={"Authorization": f"Bearer {replica.token}"},
    )  # fmt: skip
    assert answer.status_code in (200, 201), answer.text
    return time.time()


def forgeries(stack: ForgedStack, forger: SigningKeys, replayed: bytes) -> list[bytes]:
    """(a) an unsigned lift at revision 2**53 - 1; (b) another key's set one revision above the held one,
    quarantining calm and lifting glm; (c) the monitors' own set from before the quarantine."""
    calm = entry("calm", [stack.calm.url + "/v1"], None)
    above = {**signing_document(revision=stack.sampled.current.revision + 1), "deployments": [calm]}
    return [json.dumps(signing_document(revision=2**53 - 1)).encode(), forger.signer.sign(above), replayed]


def test_a_forged_set_moves_no_gateway_for_a_moment_and_operator_changes_still_reach_every_tap(
    forged_stack: ForgedStack, tmp_path: Path
) -> None:
    """An operator quarantines glm; then a rogue NATS client with the rights to write the bucket puts
    the three forgeries 20 times a second, each for 3 s: no customer gets an answer from glm, none is
    refused, the sampled tap never moves; after the forgery (the bucket's last value a forged one) an
    operator's lift, then (over another) a quarantine of calm, each reach both taps within 2 s."""
    stack, (first, second) = forged_stack, forged_stack.replicas
    glm, calm = key_of(stack.glm), key_of(stack.calm)
    customers = Customers(stack.proxy).start()
    try:
        first.wait_for(
            "both deployments to serve", lambda: {a.api_base for a in customers.answers} == {glm, calm}, 60
        )
        first.wait_for("the set in the bucket", lambda: stack.sampled.current.revision >= 0, 30)
        forged = forgeries(stack, make_keys(tmp_path / "forger"), held(NATS_URL, stack.bucket))
        quarantined_at = by_hand("POST", "glm", first)
        first.wait_for("glm quarantined at the sampled tap", lambda: stack.sampled.quarantined(glm), 10)
        time.sleep(CONTAINMENT_SECONDS)
        sampler = Sampler(stack.sampled, off=glm, on=calm)
        rogue = Rogue(NATS_URL, stack.bucket, forged, hold=RECHECK_SECONDS + 1).start()
        time.sleep(len(forged) * (RECHECK_SECONDS + 1))
        puts = rogue.stop(last=forged[0])
        sampler.stop()
        lifted_at = by_hand("DELETE", "glm", second)
        served_again = lambda: min(  # noqa: E731
            (a.finished for a in customers.answers if a.api_base == glm and a.finished > lifted_at),
            default=None,
        )
        back = first.wait_for("glm to serve a customer again", served_again, 15) - lifted_at
        Rogue(NATS_URL, stack.bucket, [forged[1]]).start().stop(last=forged[1])
        calm_off_at = by_hand("POST", "calm", first)
        first.wait_for("calm quarantined at the sampled tap", lambda: stack.sampled.quarantined(calm), 10)
        time.sleep(CONTAINMENT_SECONDS + 1)
    finally:
        customers.stop()
    answers = list(customers.answers)
    during = [a for a in answers if quarantined_at + CONTAINMENT_SECONDS < a.finished < lifted_at]
    last_calm = max(a.finished for a in answers if a.api_base == calm) - calm_off_at
    print(f"\n{puts} forged values; {len(during)} customer answers meanwhile, "
          f"{sum(a.api_base == glm for a in during)} from glm; {sampler.samples} samples of a tap, "
          f"{len(sampler.wrong)} wrong; after the forgery the operator's lift reached the gateway in "
          f"{back:.2f} s; the last answer from calm {last_calm:.2f} s after its quarantine")  # fmt: skip
    assert len(during) >= 20 and {(a.status, a.api_base) for a in during} == {(200, calm)}
    assert sampler.wrong == [] and sampler.samples > 500
    assert back < CONTAINMENT_SECONDS and last_calm < CONTAINMENT_SECONDS
    after_calm = [a for a in answers if a.finished > calm_off_at + CONTAINMENT_SECONDS]
    assert {(a.status, a.api_base) for a in after_calm} == {(200, glm)}
    assert_counted_and_said(stack)


def assert_counted_and_said(stack: ForgedStack) -> None:
    """Both sides counted each kind and said it; the replicas heard both taps; the rule fired."""
    kinds = {"unsigned", "unknown_key", "older"}
    assert all(stack.sampled.refused[kind] for kind in kinds), stack.sampled.refused
    foreign: dict[str, float] = {}
    for replica in stack.replicas:
        for labels, value in replica.samples("kvcanary_quarantine_bucket_foreign_total"):
            foreign[labels["reason"]] = foreign.get(labels["reason"], 0.0) + value
    assert all(foreign[kind] >= 1 for kind in kinds), foreign
    said = "".join(replica.log() for replica in stack.replicas)
    assert 1 <= said.count("held a value the monitors did not put") <= 2  # once an episode, a replica
    gateway_said = stack.proxy.output()
    assert "refused a quarantine set" in gateway_said and "no signature" in gateway_said
    reads = {labels["gateway"] for replica in stack.replicas
             for labels, value in replica.samples("kvcanary_quarantine_set_reads_total")
             if labels["via"] == "nats" and value > 0}  # fmt: skip
    assert {"gw-litellm", "gw-sampled"} <= reads, reads

    def firing() -> set[str]:
        alerts = stack.prometheus.alerts()
        ours = [a for a in alerts if a["labels"]["alertname"] == "KVCanaryQuarantineForged"]
        return {a["labels"]["reason"] for a in ours if a["state"] == "firing"}

    assert kinds <= stack.replicas[0].wait_for("the rule to fire", lambda: kinds <= firing() and firing(), 30)
