"""The gateway side of containment: a real LiteLLM proxy with the tap and
``KVCANARY_TAP_QUARANTINE=1`` keeps the deployments the monitor quarantined out of routing.

Two reference workers are two deployments of one model group. The monitor's
``GET /api/v1/quarantine`` is served by a loopback server holding the contract
(``docs/tap-protocol.md``, "Quarantine"), each set signed with a key made for the test: the network
seam. Which deployment answered a request is read from the proxy's ``x-litellm-model-api-base``
header and checked against the workers' own request counters.

- nothing quarantined: both deployments serve;
- one quarantined: within 2 s of the set changing no answer comes from it, and no request fails;
- both quarantined: a 503 at once, naming the quarantine, the target and the incident;
- the monitor stalled, then gone: the last set holds, requests are not slowed, one log line each way;
- observe mode: nothing filtered, one log line;
- the monitor's place taken by a forger (an unsigned lift at revision 2**53 - 1, a set signed by another
  key one revision above): no answer comes from the quarantined deployment while it forges, the
  gateway says what it refused, and the next set the monitors sign reaches it within 2 s;
- and the watch alone: unreadable answers keep the last set, a forked child polls on its own.

What the filter adds to a request is measured by ``bench/tap_litellm.py`` (``proxy+tap+q`` beside
``proxy+tap``, in one run), not timed here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvcanary.tap.containment.document import parse_quarantine
from kvcanary.tap.containment.litellm_filter import DeploymentsQuarantined, QuarantineFilter
from kvcanary.tap.containment.watch import MAX_BODY_BYTES, QuarantineWatch
from kvcanary.wire import api_base_key
from tests.support import WorkerProcess, launch_worker, stop_process, wait_worker
from tests.support.litellm import TAP_CALLBACK, Proxy, launch_proxy, write_proxy_config
from tests.support.loopback import Loopback
from tests.support.signing import SigningKeys, document, make_keys
from tests.tap.test_fork import fork_child, reap

GROUP = "shop"
TOKEN = "ingest-token-of-the-test-monitor"
CUSTOMER = "sk-acme-0001"
WORKER_ARGS = (
    "--mode",
    "aggregated",
    "--kv-pool-tokens",
    "4096",
    "--context-window",
    "2048",
    "--page-size",
    "16",
)
#: What containment promises: every replica stops routing to a quarantined deployment within this.
CONTAINMENT_SECONDS = 2.0
#: The test's own callback, listed before the tap's: LiteLLM's router asks each callback to filter
#: a request's deployments on every try, so its lines count the tries (a refusal retried is three).
TRIES = """
import os

from litellm.integrations.custom_logger import CustomLogger


class Tries(CustomLogger):
    async def async_filter_deployments(self, model, healthy_deployments, messages, request_kwargs=None,
                                       parent_otel_span=None):
        with open(os.environ["KVCANARY_TEST_TRIES"], "a", encoding="utf-8") as out:
            out.write(model + "\\n")
        return healthy_deployments


tries = Tries()
"""


class QuarantineMonitor:
    """The monitor's side of the contract on loopback: the set the test puts, signed with ``keys``,
    to the ingest token only; traffic posts are taken and their records kept (``records``).
    ``stall`` seconds delay every quarantine answer; ``forged`` is served instead of the set while
    it is set (a forger in the monitor's place)."""

    def __init__(self, keys: SigningKeys) -> None:
        self.signer = keys.signer
        self.deployments: list[dict[str, Any]] = []
        self.revision = 1
        self.records: list[dict[str, Any]] = []
        self.stall = 0.0
        self.reads = 0
        self.gateways: set[str] = set()
        self.forged: bytes | None = None
        self.closed = False
        self.server = Loopback(self._answer)
        self.url = self.server.url

    async def _answer(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/v1/traffic":
            self.records += json.loads(await request.aread())["records"]
            return httpx.Response(200, json={"accepted": 0, "unmatched": 0, "rejected": 0})
        if request.url.path != "/api/v1/quarantine":
            return httpx.Response(404)
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            return httpx.Response(401, json={"detail": "not authenticated"})
        if self.stall:
            await asyncio.sleep(self.stall)
        self.reads += 1
        self.gateways.add(request.headers.get("kvcanary-gateway", ""))
        if self.forged is not None:
            return httpx.Response(200, content=self.forged)
        return httpx.Response(200, content=self.signer.sign(self.document()))

    def document(self) -> dict[str, Any]:
        """The set as the monitor signs it now."""
        return {**document(revision=self.revision), "deployments": self.deployments}

    def put(self, *entries: dict[str, Any]) -> float:
        """Replace the set (a new revision); return the moment (monotonic) it changed."""
        self.deployments = list(entries)
        self.revision += 1
        return time.monotonic()

    def close(self) -> None:
        """Stop serving (the monitor gone); a second call does nothing."""
        if not self.closed:
            self.closed = True
            self.server.close()


def entry(target: str, api_bases: list[str], incident: int | None, enforced: bool = True) -> dict[str, Any]:
    """One item of the answer's ``deployments``: ``api_bases`` as the gateway spells them."""
    return {
        "target": target,
        "api_bases": [api_base_key(url) for url in api_bases],
        "incident_id": incident,
        "reason": "traffic_overlap: another caller's text in an answer",
        "since": "2026-12-01T11:59:00Z",
        "enforced": enforced,
    }


def base(worker: WorkerProcess) -> str:
    """The worker's ``api_base`` as the gateway's config names it."""
    return f"{worker.url}/v1"


def start_gateway(folder: Path, workers: list[WorkerProcess], env: dict[str, str]) -> Proxy:
    """A proxy whose model group ``GROUP`` has one deployment per worker, with the tap and ``env``,
    and the router's tries counted in ``folder / "tries.log"`` (:data:`TRIES`). Retries are on (2),
    as in production: a quarantine refusal must not be retried."""
    config = write_proxy_config(folder, {GROUP: workers[0].url}, callback=["tries.tries", TAP_CALLBACK])
    (folder / "tries.py").write_text(TRIES)
    env = {**env, "KVCANARY_TEST_TRIES": str(folder / "tries.log")}
    document = yaml.safe_load(config.read_text())
    first = document["model_list"][0]
    document["model_list"] = [
        {**first, "litellm_params": {**first["litellm_params"], "api_base": base(w)}} for w in workers
    ]
    document["litellm_settings"]["num_retries"] = 2
    config.write_text(yaml.safe_dump(document))
    return launch_proxy(config, env)


def gateway_env(monitor: QuarantineMonitor, quarantine: bool, keys: SigningKeys) -> dict[str, str]:
    env = {"KVCANARY_TAP_URL": monitor.url, "KVCANARY_TAP_TOKEN": TOKEN, "KVCANARY_TAP_GATEWAY": "gw-test",
           "KVCANARY_TAP_KEY": "a-fingerprint-key-the-monitor-never-sees"}  # fmt: skip
    if quarantine:
        env |= {"KVCANARY_TAP_QUARANTINE": "1", **keys.tap_env()}
    return env


@dataclass
class Answer:
    status: int
    api_base: str  # the deployment that answered ("" for none)
    started: float
    finished: float
    overhead_ms: float | None  # LiteLLM's own time in the request (routing and callbacks included)
    body: str


def ask(proxy: Proxy, client: httpx.Client) -> Answer:
    started = time.monotonic()
    response = client.post(
        f"{proxy.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {CUSTOMER}"},
        json={
            "model": GROUP,
            "messages": [{"role": "user", "content": "where is my parcel"}],
            "max_tokens": 2,
        },
    )
    overhead = response.headers.get("x-litellm-overhead-duration-ms")
    return Answer(
        response.status_code,
        api_base_key(response.headers.get("x-litellm-model-api-base", "")),
        started,
        time.monotonic(),
        float(overhead) if overhead not in (None, "None") else None,
        response.text,
    )


def traffic(proxy: Proxy, count: int) -> list[Answer]:
    with httpx.Client(timeout=30) as client:
        return [ask(proxy, client) for _ in range(count)]


def key_of(worker: WorkerProcess) -> str:
    return api_base_key(base(worker))


def answered(worker: WorkerProcess) -> float:
    """The worker's own count of requests it answered 200."""
    text = httpx.get(f"{worker.url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvcanary_requests_total{") and 'code="200"' in line)  # fmt: skip


def wait_for(what: str, check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.05)
    raise AssertionError(f"no {what} after {timeout} s")


@dataclass
class Stack:
    workers: list[WorkerProcess]
    monitor: QuarantineMonitor
    gateway: Proxy  # the tap with the quarantine
    keys: SigningKeys

    def tries(self) -> int:
        """How many tries the gateway's router has made of requests so far (:data:`TRIES`)."""
        log = self.gateway.log.parent / "tries.log"
        return len(log.read_text().splitlines()) if log.exists() else 0

    def settled(self, *entries: dict[str, Any]) -> None:
        """Put ``entries`` as the set and wait until the gateway has surely taken it: the second
        answer after the change began after it."""
        self.monitor.put(*entries)
        reads = self.monitor.reads
        wait_for("quarantine reads", lambda: self.monitor.reads >= reads + 2)
        time.sleep(0.1)  # the answer counted is on its way to the gateway


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("quarantine")
    keys = make_keys(folder / "keys")
    workers = [launch_worker(list(WORKER_ARGS), folder) for _ in range(2)]
    monitor = QuarantineMonitor(keys)
    proxies: list[Proxy] = []
    try:
        for worker in workers:
            wait_worker(worker)
        env = gateway_env(monitor, quarantine=True, keys=keys)
        proxies.append(start_gateway(folder / "gateway", workers, env))
        yield Stack(workers, monitor, proxies[0], keys)
    finally:
        for proc in [*(p.proc for p in proxies), *(w.proc for w in workers)]:
            stop_process(proc)
        monitor.close()


@pytest.mark.external_service
def test_with_nothing_quarantined_both_deployments_serve(stack: Stack) -> None:
    stack.settled()
    before = [answered(w) for w in stack.workers]
    answers = traffic(stack.gateway, 24)
    assert {a.status for a in answers} == {200}
    by_deployment = Counter(a.api_base for a in answers)
    assert set(by_deployment) == {key_of(w) for w in stack.workers}, by_deployment
    served = [answered(w) - b for w, b in zip(stack.workers, before, strict=True)]
    assert served == [by_deployment[key_of(w)] for w in stack.workers]


@pytest.mark.external_service
def test_a_quarantined_deployment_gets_no_request_within_two_seconds_and_the_other_serves_all(
    stack: Stack,
) -> None:
    leaking, healthy = stack.workers
    stack.settled()
    answers: list[Answer] = []
    stop = threading.Event()

    def customers() -> None:  # three callers at once, without pause
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                answers.append(ask(stack.gateway, client))

    callers = [threading.Thread(target=customers) for _ in range(3)]
    for caller in callers:
        caller.start()
    both = {key_of(w) for w in stack.workers}
    wait_for("answers from both deployments", lambda: both <= {a.api_base for a in answers}, timeout=30)
    changed_at = stack.monitor.put(entry("shared", [base(leaking)], incident=42))
    time.sleep(CONTAINMENT_SECONDS + 1.5)
    leaking_count = answered(leaking)
    time.sleep(1.5)
    stop.set()
    for caller in callers:
        caller.join(30)
    assert {a.status for a in answers} == {200}, Counter(a.status for a in answers)
    from_leaking = [a for a in answers if a.api_base == key_of(leaking)]
    # When the gateway routed a request lies between its start and its end; how long the end comes
    # after is the machine's pace (LiteLLM's own answer took over a second on a loaded 2-core run).
    # The answers that began after the promise all went elsewhere (below).
    last = max(a.started for a in from_leaking) - changed_at
    print(f"\nlast request to the quarantined deployment began {last:.3f} s after the set changed")
    assert last < CONTAINMENT_SECONDS, last
    after = [a for a in answers if a.started > changed_at + CONTAINMENT_SECONDS]
    assert len(after) >= 10 and {a.api_base for a in after} == {key_of(healthy)}
    assert answered(leaking) == leaking_count  # the worker itself saw nothing more


@pytest.mark.external_service
def test_with_every_deployment_quarantined_a_request_fails_at_once_naming_the_incident(stack: Stack) -> None:
    stack.settled(entry("shared", [base(w) for w in stack.workers], incident=42))
    before = [answered(w) for w in stack.workers]
    tried = stack.tries()
    answers = traffic(stack.gateway, 10)
    assert {a.status for a in answers} == {503}, [a.body for a in answers][:1]
    # One try a request: LiteLLM's router, told to retry twice, retries a refusal at once (no
    # backoff while it counts the group healthy: 30 tries in 0.3 s), so only the count shows it.
    assert stack.tries() - tried == len(answers)
    error = json.loads(answers[0].body)["error"]
    assert "quarantined by kvcanary" in error["message"]
    assert "'shared'" in error["message"] and "incident 42" in error["message"]
    took = sorted(a.finished - a.started for a in answers)
    print(f"\nrefusals took {took[len(took) // 2] * 1000:.1f} ms (median), {took[-1] * 1000:.1f} ms (most)")
    assert [answered(w) for w in stack.workers] == before
    # The tap sends each refusal as a record of its own, naming a deployment kept off: the monitor
    # counts it against that target, as `refused`, never as a failure of the deployment.
    refused = lambda: [r for r in stack.monitor.records if r.get("refused")]  # noqa: E731
    records = wait_for("the refusals' records", lambda: len(refused()) >= 10 and refused())
    assert {(r["status"], r["refused"]["by"], r["refused"]["incident_id"]) for r in records} == {
        (503, "quarantine", 42)
    }
    assert {r["api_base"] for r in records} <= {key_of(w) for w in stack.workers}
    assert {r["caller"] for r in records} == {"acme"}
    assert not any(r["fingerprints"]["prompt"] for r in records)  # no engine saw them: no prints


@pytest.mark.external_service
def test_observe_mode_filters_nothing_and_says_so_once(stack: Stack) -> None:
    leaking = stack.workers[0]
    stack.settled(entry("observed-target", [base(leaking)], incident=7, enforced=False))
    answers = traffic(stack.gateway, 24)
    assert {a.status for a in answers} == {200}
    assert {a.api_base for a in answers} == {key_of(w) for w in stack.workers}
    lines = [line for line in stack.gateway.output().splitlines() if "observe mode" in line]
    assert len(lines) == 1 and "'observed-target' (incident 7)" in lines[0], lines


@pytest.mark.external_service
def test_a_forger_in_the_monitors_place_moves_no_request_and_the_next_signed_set_reaches_the_gateway(
    stack: Stack, tmp_path: Path
) -> None:
    leaking, healthy = stack.workers
    stack.settled(entry("shared", [base(leaking)], incident=42))
    forger = make_keys(tmp_path / "forger")
    answers: list[Answer] = []
    stop = threading.Event()

    def customers() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                answers.append(ask(stack.gateway, client))

    callers = [threading.Thread(target=customers) for _ in range(3)]
    for caller in callers:
        caller.start()
    try:
        forging_from = time.monotonic()
        # An unsigned lift of everything at a revision no monitor reaches, then a set signed by
        # another key one revision above the real one, keeping the healthy deployment off instead.
        stack.monitor.forged = json.dumps(document(revision=2**53 - 1)).encode()
        time.sleep(3 * CONTAINMENT_SECONDS)
        above = {
            **document(revision=stack.monitor.revision + 1),
            "deployments": [entry("healthy", [base(healthy)], 7)],
        }
        stack.monitor.forged = forger.signer.sign(above)
        time.sleep(3 * CONTAINMENT_SECONDS)
        forging_until = time.monotonic()
        stack.monitor.forged = None
        lifted_at = stack.monitor.put()  # the monitors' next set, signed: the quarantine lifted
        again = lambda: any(a.api_base == key_of(leaking) and a.started > lifted_at for a in answers)  # noqa: E731
        wait_for("the leaking deployment to serve again", again, timeout=15)
    finally:
        stop.set()
        for caller in callers:
            caller.join(30)
    forging = [a for a in answers if forging_from < a.started and a.finished < forging_until]
    # Routed once the gateway took the lift: the first such request that began after it was served
    # says when (its answer's own time is the machine's pace: 2.2 s to its end on a loaded run).
    back = min(a.started for a in answers if a.api_base == key_of(leaking) and a.started > lifted_at)
    print(
        f"\n{len(forging)} answers while the monitor's place was a forger's, all from the healthy "
        f"deployment; the first request routed by the next signed set began {back - lifted_at:.2f} s "
        "after it was served"
    )
    assert len(forging) >= 20 and {(a.status, a.api_base) for a in forging} == {(200, key_of(healthy))}
    assert back - lifted_at < CONTAINMENT_SECONDS
    said = stack.gateway.output()
    assert "refused a quarantine set" in said and "no signature" in said and "signed by no key" in said
    assert stack.monitor.gateways == {"gw-test"}  # every read named the gateway


@pytest.mark.external_service
def test_a_stalled_then_gone_monitor_keeps_the_last_set_and_slows_no_request(stack: Stack) -> None:
    """Run last: it stops the loopback monitor."""
    leaking, healthy = stack.workers
    monitor = stack.monitor
    stack.settled(entry("shared", [base(leaking)], incident=42))
    up = traffic(stack.gateway, 20)
    monitor.stall = 5.0  # past the watch's 2 s timeout
    time.sleep(3 * CONTAINMENT_SECONDS)
    stalled = traffic(stack.gateway, 20)
    monitor.stall = 0.0
    wait_for("reads again", lambda: "read from the monitor again" in stack.gateway.output(), timeout=15)
    monitor.close()
    time.sleep(2 * CONTAINMENT_SECONDS)
    gone = traffic(stack.gateway, 20)
    for answers in (up, stalled, gone):
        assert {a.status for a in answers} == {200}
        assert {a.api_base for a in answers} == {key_of(healthy)}
    took = {name: statistics.median(a.finished - a.started for a in answers)
            for name, answers in (("up", up), ("stalled", stalled), ("gone", gone))}  # fmt: skip
    print(f"\nmedian request time by monitor state: { {k: f'{v * 1000:.1f} ms' for k, v in took.items()} }")
    # A request that waited on the stalled read would wait out the watch's 2 s timeout; medians of
    # 20 requests differ by the machine's pace alone (71 ms up, 196 ms stalled on a loaded run).
    assert took["stalled"] < took["up"] + 1.0 and took["gone"] < took["up"] + 1.0, took
    log = stack.gateway.output()
    assert log.count("cannot read the quarantine") == 2, log[-3000:]  # once per outage, not per poll
    assert log.count("read from the monitor again") == 1


# --- the watch and the filter in this process ------------------------------------------------------


@pytest.fixture
def keys(tmp_path: Path) -> SigningKeys:
    return make_keys(tmp_path / "keys")


@pytest.fixture
def monitor(keys: SigningKeys) -> Iterator[QuarantineMonitor]:
    served = QuarantineMonitor(keys)
    yield served
    served.close()


def deployments(*urls: str) -> list[dict[str, Any]]:
    return [{"model_name": GROUP, "litellm_params": {"api_base": u}, "model_info": {"id": u}} for u in urls]


def test_unreadable_answers_keep_the_last_set_and_are_logged_once(
    monitor: QuarantineMonitor, keys: SigningKeys, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "kvcanary.tap")
    watch = QuarantineWatch(monitor.url, TOKEN, keys=keys.public_keys, start=False)

    def held(api_base: str) -> object:
        """The set's entry as the polls left it: ``quarantined()``, a lookup, would start the
        watch's own poller, whose reads would race this test's."""
        return watch.current.enforced.get(api_base_key(api_base))

    monitor.put(entry("shared", ["http://10.0.0.1:8000/v1"], 42))
    assert watch.poll_once() and held("HTTP://10.0.0.1:8000/v1/") is not None
    read_at = watch.last_read_at
    monitor.put({"target": "t", "api_bases": ["x"], "enforced": "yes"})  # signed, but not the contract's
    for _ in range(3):
        assert not watch.poll_once()
    assert watch.refused["malformed"] == 3 and watch.last_read_at == read_at
    assert held("http://10.0.0.1:8000") is not None  # the last known set holds
    stranger = QuarantineWatch(monitor.url, "not-the-token", keys=keys.public_keys, start=False)
    assert not stranger.poll_once() and not stranger.poll_once() and stranger.failing
    failures = [r.getMessage() for r in caplog.records if "cannot read the quarantine" in r.getMessage()]
    assert len(failures) == 1 and "401" in failures[0], failures  # once per watch, not once a poll
    refusals = [r.getMessage() for r in caplog.records if "refused a quarantine set" in r.getMessage()]
    assert len(refusals) == 1 and "malformed" in refusals[0], refusals  # once a minute a reason
    monitor.put()
    assert watch.poll_once() and not watch.failing and held("http://10.0.0.1:8000") is None


@pytest.mark.parametrize(
    "change",
    [
        {"version": 1},
        {"version": 3},
        {"deployments": {}},
        {"deployments": [{"target": "t", "api_bases": "x", "enforced": True}]},
        {"deployments": [{"target": "", "api_bases": ["x"], "enforced": True}]},
        {"deployments": [{"target": "t", "api_bases": ["x"], "enforced": "yes"}]},
        {"deployments": [{"target": "t", "api_bases": ["x"], "incident_id": True, "enforced": True}]},
        {"revision": -1},
        {"revision": "7"},
        {"generated_at": "yesterday"},
        {"expires_at": "2026-12-05T07:00:00"},  # no offset
        {"expires_at": "2000-01-01T00:00:00+00:00"},  # before it was generated
    ],
)
def test_an_answer_not_the_contracts_is_refused_whole(change: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        parse_quarantine(json.dumps({**document(), **change}).encode())


def test_an_answer_over_the_bound_is_refused(monitor: QuarantineMonitor, keys: SigningKeys) -> None:
    watch = QuarantineWatch(monitor.url, TOKEN, keys=keys.public_keys, start=False)
    many = [f"http://host-{i:07d}.example:8000" for i in range(MAX_BODY_BYTES // 30)]
    monitor.put(entry("shared", many, 1))
    assert len(json.dumps(monitor.deployments)) > MAX_BODY_BYTES
    assert not watch.poll_once() and watch.current.empty
    monitor.put(entry("shared", many[: len(many) // 2], 1))
    assert watch.poll_once() and len(watch.current.enforced) == len(many) // 2


def test_a_forked_child_polls_on_its_own(monitor: QuarantineMonitor, keys: SigningKeys) -> None:
    """The parent's poller is not in the child: without one of its own, the child would hold the set
    it was forked with for ever."""
    watch = QuarantineWatch(monitor.url, TOKEN, keys=keys.public_keys, poll_seconds=0.1)
    wait_for("a first read", lambda: watch.last_read_at)

    def child() -> int:
        found = wait_for("the child's read", lambda: watch.quarantined("http://10.0.0.9:8000"), timeout=10)
        return 0 if found.incident_id == 5 else 1

    pid = fork_child(child)
    monitor.put(entry("shared", ["http://10.0.0.9:8000"], 5))  # after the fork: the child must read it
    assert reap([pid], timeout=20) == {pid: 0}
    watch.close()


def test_the_filter_removes_quarantined_deployments_and_refuses_when_none_is_left(
    monitor: QuarantineMonitor, keys: SigningKeys
) -> None:
    watch = QuarantineWatch(monitor.url, TOKEN, keys=keys.public_keys, start=False)
    monitor.put(entry("shared", ["http://a:1"], 42), entry("watched", ["http://b:1"], 7, enforced=False))
    assert watch.poll_once()
    quarantine = QuarantineFilter(watch, count=lambda target, mode: None)
    kept = quarantine.keep(GROUP, deployments("http://A:1/v1", "http://b:1", "http://c:1"))
    assert kept == deployments("http://b:1", "http://c:1")
    assert quarantine.counts == Counter({("shared", "enforced"): 1, ("watched", "observe"): 1})
    with pytest.raises(DeploymentsQuarantined) as refused:
        quarantine.keep(GROUP, deployments("http://a:1/"))
    assert refused.value.status_code == 503 and refused.value.num_retries == 0
    assert "quarantined by kvcanary" in refused.value.message and "incident 42" in refused.value.message
    api_base, why = refused.value.kvcanary_refusal  # what the tap's record of the refusal names
    assert (api_base, why.by, why.incident_id) == ("http://a:1", "quarantine", 42)
    assert quarantine.keep(GROUP, []) == []  # none to begin with: LiteLLM's own answer
