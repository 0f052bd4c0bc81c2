"""The admission guard's facts as ``kvcanary serve`` publishes them (``monitor/containment/guards.py``):
beside the quarantine set, each guarded target's smallest KV pool of the nodes that admit its
requests, read from the node itself, under the policy in force for the target (the top-level one
or the target's own). What a gateway does with them: ``tests/tap/test_admission.py`` and, through a
real LiteLLM proxy, ``tests/litellm/test_admission_litellm.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.containment.document import quarantine_set
from kvcanary.monitor.containment.guards import AdmissionFacts, GuardFacts
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.monitor.traffic.facts import MIN_CHARS_PER_TOKEN, POOL_SETTLE_SECONDS, TargetFacts
from kvcanary.tap.containment.document import parse_quarantine
from kvcanary.wire import api_base_key
from tests.monitor.runs.test_gateway_hostile import Held
from tests.monitor.served import Served, reference_target
from tests.probes.probe_harness import KEYS, FakeEngine
from tests.support import WorkerProcess
from tests.support.loopback import Loopback
from tests.support.signing import SigningKeys, make_keys, served_set
from tests.support.worker_keys import KEY_FLAGS

POOL = ["--mode", "disaggregated", "--context-window", "8192", "--decode-pool-tokens", "16384"]
SMALL = [*POOL, "--prefill-pool-tokens", "1024", "--admission", "placeholder"]
ROOMY = [*POOL, "--prefill-pool-tokens", "12288", "--admission", "reject"]
INGEST = "admission-test-ingest-token-0123456789"


def guards(monitor: Served, keys: SigningKeys) -> list[dict[str, Any]]:
    return list(served_set(monitor.url, INGEST, keys)["guards"])


def test_each_guarded_target_publishes_its_smallest_admitting_pool_under_its_own_policy(
    served: Callable[..., Served], start_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    keys = make_keys(tmp_path / "keys")  # a guard moves customers: the set must be signed
    small, roomy, unguarded = (start_worker(*args, *KEY_FLAGS) for args in (SMALL, ROOMY, ROOMY))
    probes = {"probes": ["canary"], "probe_intervals": {"canary": 60.0}}
    monitor = served({
        "targets": [
            reference_target("glm", small.url, containment={"admission_guard": "enforce"}, **probes),
            reference_target("vllm-b", roomy.url, **probes),
            reference_target("plain", unguarded.url, containment={"admission_guard": "off"}, **probes),
        ],
        "containment": {"mode": "observe", "admission_guard": "observe"},
        "containment_signing": keys.monitor_config(),
        "traffic": {"ingest_token_env": "KVC_TEST_INGEST"},
    })  # fmt: skip
    monitor.env["KVC_TEST_INGEST"] = INGEST
    monitor.start()
    published = monitor.wait_for(
        "both guards published", lambda: (g := guards(monitor, keys)) and len(g) == 2 and g, 30
    )
    by_target = {g["target"]: g for g in published}
    assert set(by_target) == {"glm", "vllm-b"}  # "plain" turned its guard off
    assert by_target["glm"]["mode"] == "enforce" and by_target["vllm-b"]["mode"] == "observe"
    # The prefill pool, the smaller of each worker's two: what must hold a prompt.
    assert by_target["glm"]["kv_pool_tokens"] == 1024 and by_target["vllm-b"]["kv_pool_tokens"] == 12288
    assert by_target["glm"]["api_bases"] == [api_base_key(small.url)]
    # Only the ingest token and the API token read it; nobody else.
    stranger = httpx.get(monitor.url + "/api/v1/quarantine", headers={"Authorization": "Bearer nope"})
    assert stranger.status_code == 401


def test_a_replica_whose_pools_are_not_read_yet_serves_no_set_without_guards(
    served: Callable[..., Served], tmp_path: Path
) -> None:
    """A set with no guard lifts every gateway's: a replica whose first pool reading is still under
    way (its node slow to answer) refuses the read, and a tap keeps the set it holds."""
    keys = make_keys(tmp_path / "keys")
    slow = Held(httpx.Response(200, json=info(16384)))
    monitor = served({
        "targets": [reference_target("glm", slow.url, containment={"admission_guard": "enforce"},
                                     probes=["canary"], probe_intervals={"canary": 3600.0},
                                     timeout_seconds=60)],
        "containment_signing": keys.monitor_config(),
        "traffic": {"ingest_token_env": "KVC_TEST_INGEST"},
    })  # fmt: skip
    monitor.env["KVC_TEST_INGEST"] = INGEST
    monitor.start()
    try:
        early = httpx.get(monitor.url + "/api/v1/quarantine", headers={"Authorization": f"Bearer {INGEST}"})
        assert early.status_code == 503 and early.headers["Retry-After"] == "1", early.text
        assert "not read yet" in early.json()["detail"]
        slow.released.set()
        published = monitor.wait_for("the guard published", lambda: guards(monitor, keys), 30)
        assert [(g["target"], g["kv_pool_tokens"]) for g in published] == [("glm", 16384)]
    finally:
        slow.close()


# --- one node cannot poison the guards ---------------------------------------------------------------


def info(pool: int, admits: int | None = None) -> dict[str, Any]:
    """A prefill node's server info, SGLang-shaped: its pool and the longest prompt it admits."""
    admits = min(8192, pool) - 1 if admits is None else admits
    return {"context_length": 8192, "max_total_num_tokens": pool, "max_req_input_len": admits,
            "page_size": 16, "disaggregation_mode": "prefill"}  # fmt: skip


def test_each_node_guards_its_own_deployment_and_a_reading_not_to_trust_guards_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A gateway target of four prefill nodes and a decode node, each an engine on loopback: a sound
    one (16,384 tokens), one that says 16 (an attacker's, or broken), one whose pool is below the
    longest prompt it says it admits, and one whose pool later falls to a sixteenth with no
    configuration change seen (believed once the capacity audit saw one, or the pool held an
    hour). Its tokenizer counts a billion tokens for any text. Each node's
    deployment is guarded by its own pool; the untrusted ones by none, and the target's own
    deployment (the gateway, the decode node's URL) by the smallest trusted pool; the calibration
    no tokenizer could have made is none."""
    engines = {
        "sound": FakeEngine(info=info(16384)),
        "tiny": FakeEngine(info=info(16)),
        "liar": FakeEngine(info=info(2048, admits=8191)),
        "shifty": FakeEngine(info=info(16384)),
        "d0": FakeEngine(info={**info(4096), "disaggregation_mode": "decode"}),
        "gateway": FakeEngine(info=None, count=lambda text: 10**9),
    }
    served = {name: Loopback(engine) for name, engine in engines.items()}
    now = [0.0]
    try:
        nodes = [
            {"name": n, "role": "prefill", "info_url": served[n].url}
            for n in ("sound", "tiny", "liar", "shifty")
        ]
        nodes.append({"name": "d0", "role": "decode", "info_url": served["d0"].url})
        target = reference_target("glm", served["gateway"].url, nodes=nodes, probes=["canary"])
        settings = Settings.model_validate(
            {
                "database_url": "sqlite:///unused.db",
                "targets": [target],
                "containment": {"admission_guard": "enforce"},
            }
        )
        glm = settings.target("glm")
        assert glm is not None

        async def run() -> list[dict[str, tuple[int, float | None]]]:
            client = OpenAIHttpTarget(glm, {"alice": KEYS["alice"], "bob": KEYS["bob"]})
            facts = TargetFacts({"glm": client}, clock=lambda: now[0])
            guards = AdmissionFacts(lambda: settings, {"glm": client}, facts)
            seen = []
            try:
                await guards.refresh()
                seen.append(by_base(guards.current()))
                counted = client.calibration.chars_per_token  # the count landed: 1e9 tokens for a text
                assert counted is not None and counted < MIN_CHARS_PER_TOKEN
                assert facts.untrusted == {
                    ("glm", "tiny"): "below_floor",
                    ("glm", "liar"): "below_own_input_limit",
                }
                engines["shifty"].info = info(1024)  # restarted smaller; no audit said so yet
                now[0] += 601  # the pools are read again
                await guards.refresh()
                seen.append(by_base(guards.current()))
                assert facts.untrusted[("glm", "shifty")] == "moved"
                now[0] += 1800  # held half an hour: still not believed without the audit's word
                await guards.refresh()
                assert by_base(guards.current()) == seen[-1]
                facts.forget_pools("glm")  # the capacity audit saw its configuration change
                await guards.refresh()
                seen.append(by_base(guards.current()))
                assert ("glm", "shifty") not in facts.untrusted
                engines["shifty"].info = info(16384)  # restarted again, and nobody audits it
                now[0] += 601
                await guards.refresh()
                assert facts.untrusted[("glm", "shifty")] == "moved"
                now[0] += POOL_SETTLE_SECONDS  # the same pool for an hour: believed
                await guards.refresh()
                seen.append(by_base(guards.current()))
                assert ("glm", "shifty") not in facts.untrusted
            finally:
                await client.aclose()
            return seen

        first, moved, confirmed, settled = asyncio.run(run())
        key = {name: api_base_key(server.url) for name, server in served.items()}
        own = {key["gateway"], key["d0"]}  # the target's deployment: any admitting node may take it
        assert first == {
            key["sound"]: (16384, None),
            key["shifty"]: (16384, None),
            **dict.fromkeys(own, (16384, None)),
        }
        assert moved == {key["sound"]: (16384, None), **dict.fromkeys(own, (16384, None))}
        assert confirmed == {
            key["sound"]: (16384, None),
            key["shifty"]: (1024, None),
            **dict.fromkeys(own, (1024, None)),
        }
        assert settled == first
        said = [r.getMessage() for r in caplog.records if "is not trusted" in r.getMessage()]
        assert len(said) == 4 and all("guards and judges nothing" in line for line in said), said
    finally:
        for server in served.values():
            server.close()


def by_base(guards: list[GuardFacts]) -> dict[str, tuple[int, float | None]]:
    """Each api_base key's guard: (pool, calibration); a key no guard names is not there."""
    found: dict[str, tuple[int, float | None]] = {}
    for guard in guards:
        for base in guard.api_bases:
            assert base not in found, f"{base} guarded twice"
            found[base] = (guard.kv_pool_tokens, guard.chars_per_token)
    return found


def test_the_set_gives_each_deployment_the_guard_of_its_own_pool() -> None:
    """Two prefill nodes of 16,384 and 1,024 tokens behind a gateway: as a tap reads the set, the
    first node's deployment is guarded at 16,384, the second's and the gateway's at 1,024."""
    roomy, small, gateway = "http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.9:30000"
    nodes = [{"name": n, "role": "prefill", "info_url": url} for n, url in (("p0", roomy), ("p1", small))]
    settings = Settings.model_validate(
        {"database_url": "sqlite:///unused.db", "targets": [reference_target("glm", gateway, nodes=nodes)]}
    )
    facts = [
        GuardFacts("glm", "enforce", 16384, 4.0, (api_base_key(roomy),)),
        GuardFacts("glm", "enforce", 1024, 4.0, tuple(sorted(map(api_base_key, (small, gateway))))),
    ]
    published = quarantine_set([], facts, settings, datetime.now(UTC))
    read = parse_quarantine(json.dumps(published).encode()).guards
    assert {base: guard.kv_pool_tokens for base, guard in read.items()} == {
        api_base_key(roomy): 16384,
        api_base_key(small): 1024,
        api_base_key(gateway): 1024,
    }
