"""The worker's HTTP app (FastAPI) and its uvicorn entry point.

Besides the OpenAI routes (``workers.openai_api``) it serves:

- ``GET /health``: 200 once the engine thread runs.
- ``GET /get_server_info`` and ``GET /server_info``: SGLang's shape (see ``server_info``).
- ``GET /get_model_info`` and ``GET /model_info``: SGLang's shape (see ``model_info``); the model
  gateway reads both when a worker registers.
- ``GET /metrics``: Prometheus text from the worker's own registry (``docs/worker-metrics.md``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvcanary.workers import __version__
from kvcanary.workers.config import DEPRECATED_MODES, PD_MODES, UNIFIED_POOL, WorkerConfig
from kvcanary.workers.dp import Ranks
from kvcanary.workers.errors import install_error_handlers
from kvcanary.workers.metrics import WorkerMetrics
from kvcanary.workers.openai_api import router

log = logging.getLogger("kvcanary.workers.server")
COUNTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
#: ``disaggregation_mode`` as SGLang names it: the in-process pair advertises its admitting side.
DISAGGREGATION_MODES = {"disaggregated": "prefill", "prefill": "prefill", "decode": "decode"}


def server_info(config: WorkerConfig, ranks: Ranks) -> dict[str, Any]:
    """Return SGLang's ``/get_server_info`` fields plus the worker's isolation settings.

    ``max_total_num_tokens`` is the pool admission checks (the unified pool, or prefill in disaggregated mode,
    which is why ``disaggregation_mode`` reads ``prefill`` there) and ``max_req_input_len`` is
    ``min(context_length, max_total_num_tokens) - 1``. With data-parallel ranks both are rank 0's, as
    SGLang's top-level fields are its first scheduler's, and ``internal_states`` lists every rank's pool.
    A prefill or decode server states ``disaggregation_enable_kv_checksum`` as SGLang's does.
    """
    first = ranks.engines[0].config
    return {
        "context_length": config.context_window,
        "context_len": config.context_window,
        "max_total_num_tokens": first.admission_pool_tokens,
        "max_req_input_len": first.max_req_input_len,
        "page_size": config.page_size,
        "max_running_requests": config.max_batch,
        "disaggregation_mode": DISAGGREGATION_MODES.get(config.mode, "null"),
        "dp_size": config.dp_size,
        "internal_states": ranks.internal_states(),
        "tp_size": 1,
        "version": f"kvcanary-reference {__version__}",
        "served_model_name": config.served_model_name,
        "kv_pools": first.pool_tokens,
        "admission": config.effective_admission,
        "verify_ownership": config.verify_ownership,
        "zero_freed_pages": config.zero_freed_pages,
        "prefix_cache": config.prefix_cache,
        "session_cache": config.session_cache,
        # The tiers that may serve a prompt's K/V, nearest first: each counted on its own in
        # kvcanary_cached_tokens_by_tier_total{tier}, so an audit can judge a salt tier by tier.
        "cache_tiers": list(config.cache_tiers),
        "cache_salt_header": config.cache_salt_header,
        "reasoning_end_str": config.reasoning_end_str,
        "status": "ready",
        **({"bootstrap_port": config.bootstrap_port} if config.bootstrap_port is not None else {}),
        # SGLang's server argument, stated where a hand-off crosses between two servers: whether
        # each is checksummed (--kv-checksum).
        **({"disaggregation_enable_kv_checksum": config.kv_checksum} if config.mode in PD_MODES else {}),
    }


def model_info(config: WorkerConfig) -> dict[str, Any]:
    """Return SGLang's ``/model_info`` shape, which the model gateway reads when a worker registers."""
    return {
        "model_path": config.served_model_name,
        "tokenizer_path": None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "kvcanary-copy",
        "architectures": ["CopyModel"],
    }


class RequestCounter:
    """ASGI middleware counting completion and chat answers by status, streams included."""

    def __init__(self, app: ASGIApp, metrics: WorkerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in COUNTED_PATHS:
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(code=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(config: WorkerConfig) -> FastAPI:
    """Return the worker app; its lifespan starts and stops the engine thread."""
    metrics = WorkerMetrics()
    metrics.describe(config)
    ranks = Ranks(config, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ranks.start()
        try:
            yield
        finally:
            ranks.stop()

    app = FastAPI(title="kvcanary reference worker", version=__version__, lifespan=lifespan)
    app.state.config = config
    app.state.ranks = ranks
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(RequestCounter, metrics=metrics)
    app.include_router(router)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info() -> dict[str, Any]:
        return server_info(config, ranks)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info() -> dict[str, Any]:
        return model_info(config)

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(config: WorkerConfig) -> None:
    """Serve ``config`` with uvicorn until SIGINT/SIGTERM."""
    if config.context_exceeds_pool:
        log.warning(
            "context window %d exceeds the admission KV pool (%d tokens): prompts over %d tokens "
            "fit the context but not the pool (the incident's misconfiguration)",
            config.context_window,
            config.admission_pool_tokens,
            config.max_req_input_len,
        )
    if config.mode in DEPRECATED_MODES:
        log.warning(
            "--mode %s is deprecated and will be removed in the next release: use --mode %s "
            "(it exports pool=%r and mode=%r; this spelling keeps 0.1's names)",
            config.mode,
            DEPRECATED_MODES[config.mode],
            UNIFIED_POOL,
            DEPRECATED_MODES[config.mode],
        )
    if not config.prefills and config.admission == "placeholder":
        log.warning("--admission placeholder has no effect in aggregated mode: the non-PD path rejects")
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level=config.log_level)
