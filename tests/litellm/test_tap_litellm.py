"""Customer traffic through a real LiteLLM proxy, judged by a real monitor.

Three callers (teams of LiteLLM keys) send realistic traffic with the ``openai`` SDK, streamed and
not, through the proxy with the kvcanary tap, to reference workers as processes; ``kvcanary serve``
probes the same workers and judges every record the tap posts.

- The defective disaggregated worker (placeholder admission, a 1,024-token prefill pool under an
  8,192-token window) answers over-pool prompts 200 from stale pages: the capacity, tokens and
  overlap checks flag them (the stale pages hold another caller's text), and incidents open and
  page to a real Alertmanager.
- The healthy worker, with a system prompt and a licence every caller sends, raises nothing.
- A monitor killed (SIGKILL) for a minute costs the gateway nothing: no request fails or slows,
  and the tap delivers what waited once it is back.
- A canary's marker read from stale pages into a customer's answer is a `traffic_marker` leak that pages.
- Afterwards no customer sentence is in the monitor's database, spool or log.
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from kvcanary.monitor.traffic.checks import BY_RESULT_KIND
from kvcanary.tap.record import MARKER_RE
from tests.monitor.served import Served, reference_target
from tests.support import WorkerProcess
from tests.support.litellm import CALLERS, Proxy
from tests.support.services import Alertmanager, start_alertmanager

DEFECTIVE = (
    "--mode", "disaggregated", "--admission", "placeholder", "--prefill-pool-tokens", "1024",
    "--decode-pool-tokens", "8192", "--context-window", "8192", "--page-size", "16",
)  # fmt: skip
HEALTHY = (
    "--mode",
    "aggregated",
    "--kv-pool-tokens",
    "16384",
    "--context-window",
    "8192",
    "--page-size",
    "16",
)
LICENCE = Path("/usr/share/common-licenses/Apache-2.0").read_text()[:1500]
SYSTEM = "You are the support assistant of a hardware shop. Answer briefly, politely and in English."
WORDS = [
    "invoice",
    "shipment",
    "warranty",
    "battery",
    "charger",
    "cable",
    "adapter",
    "router",
    "firmware",
    "refund",
    "order",
    "parcel",
    "tracking",
    "address",
    "delivery",
    "replacement",
    "screen",
    "keyboard",
    "monitor",
    "laptop",
    "printer",
    "toner",
    "cartridge",
    "subscription",
    "renewal",
    "discount",
    "coupon",
    "voucher",
    "receipt",
    "payment",
    "account",
    "password",
    "login",
]


def customer_sentence(rng: random.Random, caller: str, n: int) -> str:
    """A customer's own text: words no other caller's text shares in order."""
    return f"{caller} asks: " + " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def monitor_config(url: str, **traffic: Any) -> dict[str, Any]:
    target = reference_target("shared", url, probes=["canary"], interval_seconds=1.0)
    return {
        "targets": [target],
        "traffic": {"pass_interval_seconds": 1, **traffic},
        "incidents": {"resolve_after_passes": 2},
    }


def tap_env(monitor: Served) -> dict[str, str]:
    return {
        "KVCANARY_TAP_URL": monitor.url,
        "KVCANARY_TAP_TOKEN": monitor.env["KVCANARY_INGEST_TOKEN"],
        "KVCANARY_TAP_KEY": "a-fingerprint-key-the-monitor-never-sees",
        "KVCANARY_TAP_GATEWAY": "litellm-test",
    }


def with_ingest_token(monitor: Served) -> Served:
    monitor.env["KVCANARY_INGEST_TOKEN"] = "ingest-" + monitor.token[:20]
    return monitor


def client_of(proxy: Proxy, key: str) -> OpenAI:
    return OpenAI(base_url=f"{proxy.url}/v1", api_key=key, max_retries=0, timeout=60)


def ask(client: OpenAI, model: str, messages: list[dict[str, str]], stream: bool, max_tokens: int) -> str:
    if stream:
        parts = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            stream=True,
            temperature=0,  # type: ignore[arg-type]
        )
        return "".join((c.choices[0].delta.content or "") for c in parts if c.choices)
    answer = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0
    )  # type: ignore[arg-type]
    return answer.choices[0].message.content or ""


def wait_calibrated(monitor: Served) -> None:
    """The canary has sized its prompts with the worker's tokenizer a few times."""
    monitor.wait_for(
        "canary passes",
        lambda: len(monitor.get("/api/v1/probe-results", probe="canary").json()["items"]) >= 3,
    )


def open_traffic_incidents(monitor: Served) -> dict[str, dict[str, Any]]:
    items = monitor.get("/api/v1/incidents", state="open").json()["items"]
    return {i["probe"]: i for i in items if i["probe"].startswith("traffic_")}


@pytest.fixture
def paged_defective(
    tmp_path: Path,
    start_worker: Callable[..., WorkerProcess],
    served: Callable[..., Served],
    litellm_proxy: Callable[..., Proxy],
) -> Iterator[tuple[Served, Proxy, Alertmanager]]:
    """The defective worker behind the proxy with the tap, probed and judged by a monitor that
    pages a real Alertmanager; the canary has sized its prompts."""
    worker = start_worker(*DEFECTIVE)
    am = start_alertmanager(tmp_path / "am")
    try:
        config = {**monitor_config(worker.url), "alertmanagers": [{"url": am.url}]}
        monitor = with_ingest_token(served(config)).start()
        proxy = litellm_proxy({"shop": worker.url}, tap_env(monitor))
        wait_calibrated(monitor)
        yield monitor, proxy, am
    finally:
        am.stop()


@pytest.mark.external_service
def test_over_pool_answers_in_customer_traffic_open_incidents_and_page(
    paged_defective: tuple[Served, Proxy, Alertmanager],
) -> None:
    monitor, proxy, am = paged_defective
    rng = random.Random(7)
    sentences: list[str] = []
    for round_ in range(6):
        for i, key in enumerate(CALLERS):
            team = CALLERS[key][0]
            text = customer_sentence(rng, team, 90 + 15 * (round_ % 3))  # under the 1,024-token pool
            sentences.append(text)
            ask(
                client_of(proxy, key),
                "shop",
                [{"role": "user", "content": text}],
                stream=i % 2 == 0,
                max_tokens=64,
            )
        # One caller's long prompt, over the 1,024-token prefill pool: the defect's trigger.
        over = " ".join(customer_sentence(rng, "globex", 60) for _ in range(6))
        sentences.append(over)
        ask(
            client_of(proxy, "sk-globex-0002"),
            "shop",
            [{"role": "user", "content": over}],
            stream=round_ % 2 == 1,
            max_tokens=600,
        )
    found = monitor.wait_for(
        "capacity, tokens and overlap incidents",
        lambda: (
            (o := open_traffic_incidents(monitor)).keys()
            >= {"traffic_capacity", "traffic_tokens", "traffic_overlap"}
            and o
        ),
        timeout=60,
    )
    assert found["traffic_capacity"]["severity"] == "high"
    assert found["traffic_overlap"]["severity"] == "critical"
    kept = monitor.get("/api/v1/traffic", target="shared", check="capacity").json()["items"]
    assert kept and all(r["caller"] == "globex" and r["status_code"] == 200 for r in kept)
    assert all(r["estimated_prompt_tokens"] > r["kv_pool_tokens"] == 1024 for r in kept)
    overlap = monitor.get("/api/v1/traffic", check="overlap").json()["items"]
    assert overlap and all(r["findings"]["overlap"]["other_caller"] != r["caller"] for r in overlap)

    def paged() -> list[dict[str, Any]]:
        alerts = [a for a in am.alerts(target="shared") if a["labels"]["probe"].startswith("traffic_")]
        wanted = {"traffic_capacity", "traffic_overlap"} <= {a["labels"]["probe"] for a in alerts}
        return alerts if wanted else []

    for alert in monitor.wait_for("pages", paged):
        assert alert["labels"]["check"] == BY_RESULT_KIND[alert["labels"]["probe"]].name
    assert_no_customer_text(monitor, sentences)


@pytest.mark.external_service
def test_a_canarys_marker_in_a_customers_answer_is_a_leak_that_pages(
    paged_defective: tuple[Served, Proxy, Alertmanager],
) -> None:
    """The canary plants markers every second; freed pages are handed out last-freed first, so a
    customer's over-pool request answered from stale decode pages reads the canary's own."""
    monitor, proxy, am = paged_defective
    rng = random.Random(5)
    sentences, carried = [], 0
    for _ in range(8):
        over = " ".join(customer_sentence(rng, "initech", 60) for _ in range(6))
        sentences.append(over)
        answer = ask(client_of(proxy, "sk-initech-0003"), "shop", [{"role": "user", "content": over}],
                     stream=False, max_tokens=600)  # fmt: skip
        carried += bool(MARKER_RE.search(answer))
        if carried >= 2:
            break
        time.sleep(0.7)  # a canary run between two requests
    assert carried, "no over-pool answer carried a marker-shaped string"
    found = monitor.wait_for(
        "a traffic_marker incident", lambda: open_traffic_incidents(monitor).get("traffic_marker")
    )
    assert found["severity"] == "critical"
    kept = monitor.get("/api/v1/traffic", target="shared", check="marker").json()["items"]
    assert kept and all(r["caller"] == "initech" for r in kept)
    results = monitor.get("/api/v1/probe-results", probe="traffic_marker", verdict="leak").json()
    result = results["items"][0]
    assert {r["caller"] for r in result["evidence"]["records"]} == {"initech"}
    markers = [m for r in kept for m in r["findings"]["marker"]["markers"]]
    assert markers and all(m["owner_target"] == "shared" and m["marker_sha256"] for m in markers)
    assert "KVC-" not in str(result) and "KVC-" not in str(kept)  # ids and digests, never a marker
    alert = monitor.wait_for("the page", lambda: am.alerts(target="shared", probe="traffic_marker"))[0]
    assert alert["labels"]["check"] == "marker" and alert["labels"]["severity"] == "critical"
    assert_no_customer_text(monitor, sentences)


def assert_no_customer_text(monitor: Served, sentences: list[str]) -> None:
    """No sentence a customer sent (nor a long piece of one) is in the database, spool or log."""
    db = monitor.tmp / "kvcanary.db"
    dump = "\n".join(sqlite3.connect(db).iterdump())
    files = [
        dump,
        monitor.log(),
        *(p.read_text(errors="replace") for p in (monitor.tmp / "spool").rglob("*") if p.is_file()),
    ]
    for text in sentences:
        for piece in (text[:60], text[len(text) // 2 : len(text) // 2 + 60]):
            assert all(piece not in f for f in files), f"a customer's text is stored: {piece!r}"


@pytest.mark.external_service
def test_a_healthy_worker_with_shared_boilerplate_raises_nothing_and_a_dead_monitor_costs_the_gateway_nothing(
    start_worker: Callable[..., WorkerProcess],
    served: Callable[..., Served],
    litellm_proxy: Callable[..., Proxy],
) -> None:
    worker = start_worker(*HEALTHY)
    monitor = with_ingest_token(served(monitor_config(worker.url))).start()
    proxy = litellm_proxy({"shop": worker.url}, tap_env(monitor))
    wait_calibrated(monitor)
    rng = random.Random(11)

    def round_of_traffic(n: int, spread_over: float = 0.0) -> list[float]:
        took = []
        for i in range(n):
            time.sleep(spread_over / n)
            key = list(CALLERS)[i % len(CALLERS)]
            question = customer_sentence(rng, CALLERS[key][0], 40)
            # Every caller sends the same system prompt and licence; the model quotes its caller.
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": LICENCE + "\n" + question},
            ]
            started = time.monotonic()
            ask(client_of(proxy, key), "shop", messages, stream=i % 2 == 1, max_tokens=300)
            took.append(time.monotonic() - started)
        return took

    up = round_of_traffic(12)
    monitor.wait_for(
        "records judged",
        lambda: (monitor.value("kvcanary_traffic_records_total", check="overlap") or 0) >= 12,
    )
    assert monitor.proc is not None
    os.killpg(monitor.proc.pid, signal.SIGKILL)  # killed, for a minute: the gateway must not notice
    monitor.proc.wait(10)
    down = round_of_traffic(12, spread_over=60.0)
    assert sorted(down)[len(down) // 2] < 2 * sorted(up)[len(up) // 2] + 0.05, (up, down)
    monitor.start(migrate=False)
    monitor.wait_for(
        "the records that waited",
        lambda: (monitor.value("kvcanary_traffic_records_total", check="overlap") or 0) >= 12,
    )
    assert open_traffic_incidents(monitor) == {}
    flagged = [
        labels
        for labels, value in monitor.samples("kvcanary_traffic_records_total")
        if labels["verdict"] != "pass" and value
    ]
    assert flagged == []
    assert monitor.value("kvcanary_traffic_records_total", check="marker", verdict="pass") >= 12
