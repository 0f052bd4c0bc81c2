"""Read a node's KV pool and context window from whatever the engine publishes.

The incident's configuration was a context window (1,048,576) larger than the prefill KV pool
(681,280). Each engine states the two in different places (``docs/engines.md``):

- SGLang and the reference worker: ``GET /get_server_info`` (newer SGLang: ``/server_info``):
  ``context_length``, ``max_total_num_tokens`` (the pool), ``max_req_input_len``, ``page_size``,
  ``disaggregation_mode``, ``version``; the reference worker adds ``kv_pools`` per role. Behind an
  SGLang PD router the answer is ``{"prefill": [...], "decode": [...]}``, one entry per node.
  SGLang's ``GET /metrics`` (``--enable-metrics``) states the window and the pool too, as gauges set
  once at startup (``sglang:context_len``, ``sglang:max_total_num_tokens``): read when neither server
  info answers, and for the window when the server info has none (the default).
- vLLM: ``GET /v1/models`` ``max_model_len``; ``GET /metrics`` ``vllm:cache_config_info`` labels
  ``num_gpu_blocks`` x ``block_size``; ``GET /version``.
- llama.cpp: ``GET /props`` ``default_generation_settings.n_ctx`` (per slot; the slot is the pool).
- Hosted OpenAI-compatible APIs: ``/v1/models`` ``max_model_len`` when they say it.

Every lookup that fails leaves its fields None; nothing here raises on a bad answer. What the
engine wrote is the engine's: names, versions and facts are bounded and made plain here
(``probes/untrusted.py``), at most ``MAX_POOLS`` pools a node (the smallest, which admission and
the audit care about), so nothing it writes reaches a title, a page or a metric label raw.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

from prometheus_client.parser import text_string_to_metric_families

from kvcanary.probes.target import ServerCapacity
from kvcanary.probes.untrusted import word

#: Pools kept per node (a node has one to three; an engine sending thousands must not grow series).
MAX_POOLS = 16
#: Facts kept per node, and the length of each value.
MAX_FACTS = 64
FACT_CHARS = 256
OVERRIDABLE = ("context_window", "kv_pool_tokens", "max_req_input_len", "page_size")
ROLES = ("prefill", "decode")
# Names a pool's size goes by inside a kv_pools entry.
_POOL_SIZE_KEYS = ("tokens", "max_total_num_tokens", "capacity_tokens", "size")


class Lookups(Protocol):
    async def get_json(self, path: str) -> Any | None: ...

    async def get_text(self, path: str) -> str | None: ...


def _int(value: Any) -> int | None:
    """Return a positive int from an int or a numeric string ("16", "1024.0"), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if isinstance(value, float | str):
        try:
            number = float(value)
        except ValueError:
            return None
        if not math.isfinite(number):  # "inf" or 1e999 from a hostile engine is no size
            return None
        return int(number) if number > 0 and number == int(number) else None
    return None


#: SGLang server arguments (and the reference worker's settings) kept as node facts: what a known
#: defect may require, and what fingerprints a node's configuration.
SGLANG_FACTS = (
    "model_path", "served_model_name", "quantization", "kv_cache_dtype", "dtype", "tp_size", "dp_size",
    "pp_size", "ep_size", "mem_fraction_static", "max_total_tokens", "context_length", "page_size",
    "chunked_prefill_size", "disaggregation_mode", "disaggregation_transfer_backend", "disable_radix_cache",
    "enable_cache_report", "allow_auto_truncate", "admission", "verify_ownership", "zero_freed_pages",
    "prefix_cache", "disaggregation_enable_kv_checksum", "enable_hierarchical_cache",
    "hicache_storage_backend", "session_cache", "cache_salt_header",
)  # fmt: skip
#: List-valued settings kept as facts, their items joined by commas (the reference worker's cache tiers).
SGLANG_LIST_FACTS = ("cache_tiers",)


def _scalar(value: Any) -> bool:
    return isinstance(value, str | int | float | bool)


def _version(value: Any) -> str | None:
    """Return a version only when the engine sent a non-empty string: a number or null is no version."""
    return value.strip() if isinstance(value, str) and value.strip() else None


def _min(*values: int | None) -> int | None:
    known = [v for v in values if v]
    return min(known) if known else None


async def read_capacity(lookups: Lookups, engine: str) -> ServerCapacity:
    """Return the capacity ``engine`` publishes through ``lookups``; unknown fields stay None."""
    if engine in ("sglang", "reference"):
        found = await _sglang(lookups, metrics=engine == "sglang")
    elif engine == "vllm":
        found = await _vllm(lookups)
    elif engine == "llamacpp":
        found = await _llamacpp(lookups)
    else:
        found = ServerCapacity(context_window=await _max_model_len(lookups), source="/v1/models")
    return neutralised(found)


def neutralised(found: ServerCapacity) -> ServerCapacity:
    """Return ``found`` with every string the engine wrote made plain and bounded (module docstring)."""
    pools: dict[str, int] = {}
    for name, tokens in sorted(found.pools.items(), key=lambda item: (item[1], item[0])):
        if len(pools) == MAX_POOLS:
            break
        pools.setdefault(word(name), tokens)
    facts = {word(key): word(value, FACT_CHARS) for key, value in list(found.facts.items())[:MAX_FACTS]}
    if len(found.pools) > len(pools):
        facts["pools_not_kept"] = str(len(found.pools) - len(pools))
    return dataclasses.replace(
        found,
        version=None if found.version is None else word(found.version),
        disaggregation_mode=None if (mode := found.disaggregation_mode) is None else word(mode, 32),
        pools=pools,
        facts=facts,
    )


def apply_overrides(found: ServerCapacity, options: dict[str, Any]) -> ServerCapacity:
    """Return ``found`` with the fields an operator stated in ``options`` replaced."""
    stated = {k: v for k in OVERRIDABLE if (v := _int(options.get(k))) is not None}
    if not stated:
        return found
    result = dataclasses.replace(found, source=f"{found.source}+config" if found.source else "config")
    for name, value in stated.items():
        setattr(result, name, value)
    return result


# --- SGLang and the reference worker ---------------------------------------------------------------


async def _sglang(lookups: Lookups, *, metrics: bool) -> ServerCapacity:
    """Read server info; with ``metrics`` (SGLang itself, not the reference worker) fall back to its
    ``/metrics`` gauges for what server info does not say."""
    # /server_info first: since late 2025 SGLang logs a deprecation warning on every /get_server_info.
    source = "/server_info"
    info = await lookups.get_json(source)
    if not isinstance(info, dict):
        source = "/get_server_info"
        info = await lookups.get_json(source)
    if not isinstance(info, dict):
        stated = await _sglang_gauges(lookups) if metrics else {}
        cap = _sglang_from_gauges(stated) if stated else ServerCapacity(source="")
        return await _window_from_models(lookups, cap)
    if isinstance(info.get("prefill"), list) and isinstance(info.get("decode"), list):
        return _sglang_router(info, source)
    cap = _sglang_node(info, source)
    # SGLang reports null unless --context-length was given: the effective window (0.5.23 included) is
    # only in /metrics and /v1/models then.
    if (
        cap.context_window is None
        and metrics
        and (window := (await _sglang_gauges(lookups)).get("context_window"))
    ):
        cap.context_window = window
        cap.source += ",/metrics"
    return await _window_from_models(lookups, cap)


async def _window_from_models(lookups: Lookups, cap: ServerCapacity) -> ServerCapacity:
    """Return ``cap`` with the window from ``/v1/models`` when nothing else stated it."""
    if cap.context_window is None:
        cap.context_window = await _max_model_len(lookups)
        cap.source = f"{cap.source},/v1/models" if cap.source else "/v1/models"
    return cap


#: SGLang's scheduler gauges, set once at startup (srt/observability/metrics_collector.py
#: ``emit_constants`` in 0.5.23), and the capacity field each states.
_SGLANG_GAUGES = {
    "sglang:context_len": "context_window",
    "sglang:max_total_num_tokens": "kv_pool_tokens",
    "sglang:page_size": "page_size",
}
#: SGLang's ``engine_type`` label (``DisaggregationMode.to_engine_type``) as its server info's mode.
_SGLANG_ENGINE_TYPES = {"prefill": "prefill", "decode": "decode", "unified": "null"}


async def _sglang_gauges(lookups: Lookups) -> dict[str, Any]:
    """Return what SGLang's ``/metrics`` states of capacity: each field of ``_SGLANG_GAUGES`` (the
    smallest over its series: one per scheduler, and a request must fit each) and the
    ``disaggregation_mode`` its ``engine_type`` label says; empty when the page says none of it."""
    stated: dict[str, Any] = {}
    try:
        families = list(text_string_to_metric_families(await lookups.get_text("/metrics") or ""))
    except Exception:  # A page that does not parse states nothing.
        return {}
    for family in families:
        for sample in family.samples:
            field = _SGLANG_GAUGES.get(sample.name)
            if field is None or (value := _int(sample.value)) is None:
                continue
            stated[field] = min(value, stated.get(field, value))
            if mode := _SGLANG_ENGINE_TYPES.get(sample.labels.get("engine_type", "")):
                stated.setdefault("disaggregation_mode", mode)
    return stated


def _sglang_from_gauges(stated: dict[str, Any]) -> ServerCapacity:
    """Return the capacity SGLang's ``/metrics`` stated, for a node whose server info is unreachable."""
    return ServerCapacity(
        context_window=stated.get("context_window"),
        kv_pool_tokens=stated.get("kv_pool_tokens"),
        page_size=stated.get("page_size"),
        disaggregation_mode=stated.get("disaggregation_mode"),
        source="/metrics",
    )


def _sglang_node(info: dict[str, Any], source: str) -> ServerCapacity:
    # Scheduler fields are top-level in most releases and inside internal_states[0] in others.
    states = info.get("internal_states")
    inner = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}

    def pick(*keys: str) -> Any:
        for key in keys:
            for where in (info, inner):
                if where.get(key) is not None:
                    return where[key]
        return None

    pools = _pools(info.get("kv_pools"))
    ranks = _rank_pools(states)
    mode = pick("disaggregation_mode")
    facts = {key: str(value) for key in SGLANG_FACTS if (value := pick(key)) is not None and _scalar(value)}
    for key in SGLANG_LIST_FACTS:
        items = pick(key)
        if isinstance(items, list) and all(isinstance(item, str) for item in items):
            facts[key] = ",".join(items[:16])
    return ServerCapacity(
        context_window=_int(pick("context_length", "context_len", "max_model_len")),
        kv_pool_tokens=_min(_int(pick("max_total_num_tokens")), *pools.values(), *ranks.values()),
        max_req_input_len=_int(pick("max_req_input_len")),
        page_size=_int(pick("page_size")),
        max_running_requests=_int(pick("max_running_requests")),
        disaggregation_mode=str(mode) if mode is not None else None,
        version=_version(info.get("version")),
        pools=pools,
        source=source,
        facts=facts,
        rank_pools=ranks,
    )


def _rank_pools(states: Any) -> dict[int, int]:
    """Return each data-parallel rank's pool from ``internal_states`` (one entry per rank, in rank
    order, its ``dp_rank`` where stated): the top-level fields are one rank's, and a smaller pool
    on another rank would hide behind them."""
    if not isinstance(states, list) or len(states) < 2:
        return {}
    pools: dict[int, int] = {}
    for index, state in enumerate(states[:64]):
        if not isinstance(state, dict):
            continue
        rank = _int(state.get("dp_rank"))
        if (tokens := _int(state.get("max_total_num_tokens"))) is not None:
            pools[rank if rank is not None else index] = tokens
    return pools


def _sglang_router(info: dict[str, Any], source: str) -> ServerCapacity:
    """Combine a PD router's per-node answers: a request must fit every node it can land on."""
    nodes = {role: [_sglang_node(n, source) for n in info[role] if isinstance(n, dict)] for role in ROLES}
    pools: dict[str, int] = {}
    for role, caps in nodes.items():
        if (pool := _min(*(c.kv_pool_tokens for c in caps))) is not None:
            pools[role] = pool
    every = nodes["prefill"] + nodes["decode"]
    return ServerCapacity(
        context_window=_min(*(c.context_window for c in every)),
        kv_pool_tokens=_min(*pools.values()),
        max_req_input_len=_min(*(c.max_req_input_len for c in every)),
        page_size=next((c.page_size for c in every if c.page_size), None),
        max_running_requests=_min(*(c.max_running_requests for c in nodes["decode"])),
        disaggregation_mode="router",
        version=next((c.version for c in every if c.version), None),
        pools=pools,
        source=source,
    )


def _pools(raw: Any) -> dict[str, int]:
    """Parse ``kv_pools``: ``{"prefill": 1024}``, ``{"prefill": {"tokens": 1024}}`` or a list of those."""
    if isinstance(raw, list):
        named = {}
        for i, item in enumerate(raw):
            if isinstance(item, dict):
                named[str(item.get("name") or item.get("role") or i)] = item
        raw = named
    if not isinstance(raw, dict):
        return {}
    pools: dict[str, int] = {}
    for name, value in raw.items():
        if isinstance(value, dict):
            value = next((value[k] for k in _POOL_SIZE_KEYS if k in value), None)
        if (tokens := _int(value)) is not None:
            pools[str(name)] = tokens
    return pools


# --- vLLM, llama.cpp, hosted APIs -----------------------------------------------------------------


async def _max_model_len(lookups: Lookups) -> int | None:
    models = await lookups.get_json("/v1/models")
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        return None
    return _min(*(_int(m.get("max_model_len")) for m in data if isinstance(m, dict)))


async def _vllm(lookups: Lookups) -> ServerCapacity:
    pool, block_size, labels = _vllm_cache_config(await lookups.get_text("/metrics") or "")
    version = await lookups.get_json("/version")
    return ServerCapacity(
        context_window=await _max_model_len(lookups),
        kv_pool_tokens=pool,
        page_size=block_size,
        version=_version(version.get("version")) if isinstance(version, dict) else None,
        pools={"gpu": pool} if pool else {},
        source="/v1/models,/metrics",
        facts=labels,
    )


def _vllm_cache_config(metrics_text: str) -> tuple[int | None, int | None, dict[str, str]]:
    """Return (pool tokens, block size, labels) from ``vllm:cache_config_info``; the smallest engine's pool.

    The labels are vLLM's CacheConfig as strings (``enable_prefix_caching="True"``): node facts.
    """
    pools: list[int] = []
    block_size: int | None = None
    labels: dict[str, str] = {}
    try:
        families = list(text_string_to_metric_families(metrics_text))
    except Exception:  # A scrape that does not parse says nothing about the pool.
        return None, None, {}
    for family in families:
        if family.name not in ("vllm:cache_config_info", "vllm:cache_config"):
            continue
        for sample in family.samples:
            blocks, size = _int(sample.labels.get("num_gpu_blocks")), _int(sample.labels.get("block_size"))
            if blocks and size:
                pools.append(blocks * size)
                block_size = size
                labels = dict(sample.labels)
    return (min(pools) if pools else None), block_size, labels


async def _llamacpp(lookups: Lookups) -> ServerCapacity:
    props = await lookups.get_json("/props")
    if not isinstance(props, dict):
        return ServerCapacity(source="/props unavailable")
    settings = props.get("default_generation_settings")
    n_ctx = _int(settings.get("n_ctx")) if isinstance(settings, dict) else None
    n_ctx = n_ctx or _int(props.get("n_ctx"))
    build = props.get("build_info")
    facts = {k: str(props[k]) for k in ("model_path", "total_slots") if _scalar(props.get(k))}
    # A llama.cpp slot holds one sequence's KV: the per-slot n_ctx is both window and pool.
    return ServerCapacity(
        context_window=n_ctx,
        kv_pool_tokens=n_ctx,
        version=_version(build),
        pools={"slot": n_ctx} if n_ctx else {},
        source="/props",
        facts=facts,
    )
