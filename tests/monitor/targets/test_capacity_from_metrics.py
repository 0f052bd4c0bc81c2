"""The capacity audit from SGLang's ``/metrics`` alone, over a real socket on 127.0.0.1.

SGLang states its window and pool on ``/metrics`` too (``sglang:context_len``,
``sglang:max_total_num_tokens``, set once at startup): ``read_capacity`` reads them when neither
``/server_info`` nor ``/get_server_info`` answers, and takes the window from them when the server
info has none (the default: ``context_length`` is null unless ``--context-length`` was given). The
pages are the hand-written 0.5.23 fixtures of ``tests/fixtures/engines/`` (README there), served by
a loopback HTTP server to the monitor's own client.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.probes.base import ProbeResult, Verdict
from kvcanary.probes.markers import MarkerBook
from kvcanary.probes.target import ServerCapacity
from tests.monitor.targets.test_targets import call, make_target
from tests.probes.probe_harness import loopback_target

ENGINES = Path(__file__).resolve().parents[2] / "fixtures" / "engines"
PREFILL_PAGE = (ENGINES / "sglang-0.5.23-metrics-prefill.txt").read_text()
UNIFIED_PAGE = (ENGINES / "sglang-0.5.23-metrics-unified.txt").read_text()
SERVER_INFO_NO_WINDOW = json.loads((ENGINES / "sglang-0.5.11-single-context-null.json").read_text())
MODELS = json.loads((ENGINES / "sglang-0.5.11-v1-models.json").read_text())


class Serving:
    """Answer GETs from ``pages`` (str: Prometheus text, else JSON); every other path is a 404, as
    SGLang answers a path it does not serve. The paths asked are kept in ``asked``."""

    def __init__(self, pages: dict[str, Any]):
        self.pages = pages
        self.asked: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.asked.append(request.url.path)
        page = self.pages.get(request.url.path)
        if page is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        if isinstance(page, str):
            return httpx.Response(200, text=page, headers={"content-type": "text/plain; version=0.0.4"})
        return httpx.Response(200, json=page)


def capacity(pages: dict[str, Any] | Serving, engine: str = "sglang") -> ServerCapacity:
    handler = pages if isinstance(pages, Serving) else Serving(pages)
    found: ServerCapacity = asyncio.run(call(make_target(handler, engine=engine), lambda t: t.capacity()))
    return found


def test_a_node_whose_server_info_is_unreachable_is_read_from_its_metrics() -> None:
    cap = capacity({"/metrics": PREFILL_PAGE})
    assert (cap.context_window, cap.kv_pool_tokens, cap.page_size) == (1048576, 681280, 64)
    assert (cap.disaggregation_mode, cap.source) == ("prefill", "/metrics")
    assert cap.admission_limit == 681280


def test_the_metrics_engine_type_unified_reads_as_sglangs_own_null_mode() -> None:
    assert capacity({"/metrics": UNIFIED_PAGE}).disaggregation_mode == "null"


def test_a_metrics_page_without_the_window_takes_it_from_v1_models() -> None:
    no_window = "\n".join(line for line in PREFILL_PAGE.splitlines() if "sglang:context_len" not in line)
    cap = capacity({"/metrics": no_window + "\n", "/v1/models": MODELS})
    assert (cap.context_window, cap.kv_pool_tokens, cap.source) == (1048576, 681280, "/metrics,/v1/models")


def test_the_window_missing_from_server_info_comes_from_the_metrics_gauge() -> None:
    # A window other than /v1/models' shows which of the two was read.
    page = UNIFIED_PAGE.replace("} 1048576.0", "} 524288.0")
    cap = capacity({"/server_info": SERVER_INFO_NO_WINDOW, "/metrics": page, "/v1/models": MODELS})
    assert (cap.context_window, cap.kv_pool_tokens, cap.max_req_input_len) == (524288, 681280, 681274)
    assert (cap.source, cap.version) == ("/server_info,/metrics", "0.5.11")


def test_a_window_the_server_info_states_is_kept_and_metrics_are_not_asked() -> None:
    info = {**SERVER_INFO_NO_WINDOW, "context_length": 262144}
    engine = Serving({"/server_info": info, "/metrics": UNIFIED_PAGE})
    cap = capacity(engine)
    assert (cap.context_window, cap.source) == (262144, "/server_info")
    assert "/metrics" not in engine.asked


def test_without_metrics_the_server_info_node_still_falls_back_to_v1_models() -> None:
    cap = capacity({"/server_info": SERVER_INFO_NO_WINDOW, "/v1/models": MODELS})
    assert (cap.context_window, cap.source) == (1048576, "/server_info,/v1/models")


def test_the_reference_worker_is_never_read_from_sglang_gauges() -> None:
    # The fallback is SGLang's: a reference worker's page has no sglang: gauges, and a stray one
    # must not size it.
    cap = capacity({"/metrics": PREFILL_PAGE, "/v1/models": MODELS}, engine="reference")
    assert (cap.kv_pool_tokens, cap.source) == (None, "/v1/models")


def test_the_smallest_scheduler_states_the_pool_of_a_data_parallel_node() -> None:
    second = PREFILL_PAGE.replace('tp_rank="0"} 681280.0', 'tp_rank="0",dp_rank="1"} 655360.0')
    page = PREFILL_PAGE + "\n".join(line for line in second.splitlines() if 'dp_rank="1"' in line) + "\n"
    assert capacity({"/metrics": page}).kv_pool_tokens == 655360


def test_nothing_stated_anywhere_leaves_capacity_unknown() -> None:
    cap = capacity({"/metrics": "# HELP other_metric x\n# TYPE other_metric gauge\nother_metric 1.0\n"})
    assert (cap.context_window, cap.kv_pool_tokens, cap.source) == (None, None, "/v1/models")
    assert capacity({"/metrics": "<html>not prometheus {{{"}).kv_pool_tokens is None


def test_the_capacity_audit_finds_the_incident_from_metrics_alone() -> None:
    config = TargetConfig(
        name="sg", base_url="http://engine.test:30000", engine="sglang", model="GLM-5.3",
        tenants=[{"name": "alice"}], probes=["capacity"],
    )  # fmt: skip

    async def go() -> ProbeResult:
        async with loopback_target(config, {"alice": None}, Serving({"/metrics": PREFILL_PAGE})) as target:
            return (await execute_probe("capacity", target, MarkerBook(), config, node=target.nodes[0]))[0]

    result = asyncio.run(go())
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "pool_below_context_window"), result.detail
    assert result.evidence["pools"] == {"prefill": 681280}
