"""The admission guard's facts as ``kvcanary serve`` publishes them (``monitor/containment/guards.py``):
beside the quarantine set, each guarded target's smallest KV pool of the nodes that admit its
requests, read from the node itself, under the policy in force for the target (the top-level one
or the target's own). What a gateway does with them: ``tests/tap/test_admission.py`` and, through a
real LiteLLM proxy, ``tests/litellm/test_admission_litellm.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kvcanary.wire import api_base_key
from tests.monitor.served import Served, reference_target
from tests.support import WorkerProcess
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
