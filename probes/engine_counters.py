"""What each engine calls the counters kvcanary judges: one table, per engine family.

The canonical names are those of the reference worker's contract (``docs/worker-metrics.md``).
For every other engine a counter maps to the sample names that engine really exports (read in
its source or scraped from it; see ``tests/fixtures/engines/README.md``), or to nothing: an
empty tuple means "not exposed by this engine", which the ``counters`` probe reports as such and
never reads as a pass. Names are sample names as scraped (``_total`` included); a counter with
labels (``reason``, ``code``) is summed over them.

Beside the counters, two smaller tables: balances (a counter an engine breaks down by source, whose
parts must add up to it: judged by the ``counters`` probe when they stop doing so) and state gauges
(a value read as it stands, reported as evidence, never judged). Where each name comes from, and why
each verdict: ``docs/engines.md`` §3.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvcanary.probes.base import Verdict


@dataclass(frozen=True)
class Canonical:
    """One canonical counter and what an increase of it means."""

    name: str
    meaning: str
    #: The verdict an increase earns (None: recorded as evidence, never judged on its own).
    verdict: Verdict | None = None
    #: Judged only on a node that is configured to zero freed pages.
    only_when_zeroing: bool = False


CANONICAL: tuple[Canonical, ...] = (
    Canonical(
        "ownership_violations",
        "a read of a page the request did not own was refused: a foreign page reached a request",
        Verdict.LEAK,
    ),
    Canonical(
        "placeholder_substitutions",
        "an over-capacity request was swapped for a one-token placeholder: the disclosed defect is live",
        Verdict.MISMATCH,
    ),
    Canonical(
        "pages_reused_dirty",
        "pages still holding another request's K/V were handed out on a node that must zero them",
        Verdict.MISMATCH,
        only_when_zeroing=True,
    ),
    Canonical(
        "corrupted_requests",
        "requests whose logits were corrupted (NaN): their output is not the model's",
        Verdict.MISMATCH,
    ),
    Canonical("ownership_checks", "block-table entries checked against page owners"),
    Canonical("admission_rejections", "requests refused at admission"),
    Canonical(
        "kv_read_after_release",
        "a decode node finished reading KV its prefill peer no longer held (the lease had expired, the "
        "pages freed and possibly reused before the read ended): it decoded over KV nobody vouched for",
        Verdict.MISMATCH,
    ),
    Canonical("kv_transfer_failures", "disaggregated KV transfers that failed"),
    Canonical(
        "kv_checksum_failures",
        "hand-offs whose K/V did not match the digest the prefill side took (a transfer checksum caught "
        "corrupted KV and failed the request closed): the check working, on a path that corrupts",
    ),
    Canonical(
        "kv_lease_expiries",
        "KV a prefill node kept for its decode peer and released when the lease ran out, or a read a "
        "decode node declined as too late: the peer did not read it in time",
    ),
    Canonical(
        "kv_notification_failures",
        "completion notices a decode node could not send its prefill peer: that peer keeps the pages "
        "until its lease runs out",
    ),
    Canonical(
        "prefill_retries",
        "prefills that released their KV and queued again to yield to requests the decode side admitted "
        "(optimistic prefill): the request's KV was recomputed",
    ),
    Canonical(
        "engine_canary_violations",
        "the engine's own KV canary found a slot a request read whose canary is not that request's "
        "sequence (its chain hash, position, K/V bytes or token disagree): another sequence's KV, or "
        "none, under a live request",
        Verdict.LEAK,
    ),
    Canonical(
        "engine_canary_write_violations",
        "the engine's own KV canary saw a slot written with a token or position the request does not "
        "have: its inputs and its block table disagree",
        Verdict.MISMATCH,
    ),
    Canonical("prefix_cache_queries", "prompt tokens looked up in the prefix cache"),
    Canonical("prefix_cache_hits", "prompt tokens served from the prefix cache"),
    Canonical("preemptions", "requests preempted (their KV freed and recomputed later)"),
)

#: engine family -> canonical counter -> sample names (empty: not exposed by this engine).
ENGINE_COUNTERS: dict[str, dict[str, tuple[str, ...]]] = {
    "reference": {
        "ownership_violations": ("kvcanary_kv_ownership_violations_total",),
        "placeholder_substitutions": ("kvcanary_placeholder_substitutions_total",),
        "pages_reused_dirty": ("kvcanary_kv_pages_reused_dirty_total",),
        "corrupted_requests": (),
        "ownership_checks": ("kvcanary_kv_ownership_checks_total",),
        "admission_rejections": ("kvcanary_admission_rejections_total",),
        "kv_read_after_release": (),
        "kv_transfer_failures": ("kvcanary_kv_transfer_failures_total",),
        "kv_checksum_failures": ("kvcanary_kv_transfer_checksum_failures_total",),
        "kv_lease_expiries": (),
        "kv_notification_failures": (),
        "prefill_retries": (),
        "prefix_cache_queries": ("kvcanary_prefix_cache_queries_total",),
        "prefix_cache_hits": ("kvcanary_prefix_cache_hits_total",),
        "preemptions": (),
    },
    # vLLM v1 (0.32 CPU build scraped in tests/fixtures/metrics/vllm.txt; corrupted_requests only
    # with VLLM_COMPUTE_NANS_IN_LOGITS). No page-ownership or placeholder counter exists. The nixl_*
    # counters only with the NixlConnector (kv_connector/v1/nixl/stats.py of 0.32.0): failed transfers
    # already count handshake and notification failures, which the notification counter repeats.
    "vllm": {
        "ownership_violations": (),
        "placeholder_substitutions": (),
        "pages_reused_dirty": (),
        "corrupted_requests": ("vllm:corrupted_requests_total",),
        "ownership_checks": (),
        "admission_rejections": ("vllm:admission_rejections_total",),
        "kv_read_after_release": ("vllm:nixl_num_notifications_after_expiry_total",),
        "kv_transfer_failures": ("vllm:nixl_num_failed_transfers_total",),
        "kv_checksum_failures": (),
        "kv_lease_expiries": ("vllm:nixl_num_kv_expired_reqs_total",),
        "kv_notification_failures": ("vllm:nixl_num_failed_notifications_total",),
        "prefill_retries": (),
        "prefix_cache_queries": ("vllm:prefix_cache_queries_total",),
        "prefix_cache_hits": ("vllm:prefix_cache_hits_total",),
        "preemptions": ("vllm:num_preemptions_total",),
    },
    # SGLang's srt/metrics/collector.py (2026, commit 00ae9c15), srt/observability/metrics_collector.py
    # in 0.5.23: PD transfer and bootstrap failures, prefill retries, retractions; nothing on page
    # owners (tests/fixtures/engines/README.md). Its PD transfer checksum
    # (--disaggregation-enable-kv-checksum, sglang#39500; disaggregation/decode.py in 0.5.23) counts a
    # mismatch in num_transfer_failed_reqs_total and in no counter of its own: on SGLang the checksum's
    # catches are read as kv_transfer_failures. Its own KV canary (--kv-canary) only logs: the
    # canary's counters are mtail's, from alerts/mtail/sglang_kv_canary.mtail on the node's log, read
    # at the node's log_metrics_url.
    "sglang": {
        "engine_canary_violations": ("sglang_kv_canary_verify_violations_total",),
        "engine_canary_write_violations": ("sglang_kv_canary_write_violations_total",),
        "ownership_violations": (),
        "placeholder_substitutions": (),
        "pages_reused_dirty": (),
        "corrupted_requests": (),
        "ownership_checks": (),
        "admission_rejections": (),
        "kv_read_after_release": (),
        "kv_transfer_failures": (
            "sglang:num_transfer_failed_reqs_total",
            "sglang:num_bootstrap_failed_reqs_total",
        ),
        "kv_checksum_failures": (),
        "kv_lease_expiries": (),
        "kv_notification_failures": (),
        "prefill_retries": ("sglang:num_prefill_retries_total",),
        "prefix_cache_queries": ("sglang:prompt_tokens_total",),
        "prefix_cache_hits": ("sglang:cached_tokens_total",),
        "preemptions": ("sglang:num_retracted_requests_total",),
    },
    # llama.cpp server (--metrics): prompt caching counters only.
    "llamacpp": {
        "ownership_violations": (),
        "placeholder_substitutions": (),
        "pages_reused_dirty": (),
        "corrupted_requests": (),
        "ownership_checks": (),
        "admission_rejections": (),
        "kv_read_after_release": (),
        "kv_transfer_failures": (),
        "kv_checksum_failures": (),
        "kv_lease_expiries": (),
        "kv_notification_failures": (),
        "prefill_retries": (),
        "prefix_cache_queries": ("llamacpp:prompt_tokens_total",),
        "prefix_cache_hits": ("llamacpp:prompt_tokens_cached_total",),
        "preemptions": (),
    },
    # Hosted APIs publish no engine metrics.
    "openai": {c.name: () for c in CANONICAL},
}


def names_for(engine: str) -> dict[str, tuple[str, ...]]:
    """Return the canonical -> sample names map of ``engine`` (every canonical counter present)."""
    table = ENGINE_COUNTERS.get(engine, {})
    return {c.name: tuple(table.get(c.name, ())) for c in CANONICAL}


def sample_names(engine: str) -> frozenset[str]:
    """Return every sample name kvcanary reads for ``engine``: its counters' and its state gauges'
    (what it takes from a page that is not the engine's own, such as a log exporter's)."""
    counters = {name for names in names_for(engine).values() for name in names}
    return frozenset(counters | {gauge.sample for gauge in ENGINE_GAUGES.get(engine, ())})


def series_of(samples: dict[str, float], name: str) -> dict[str, float]:
    """Return each series of sample ``name`` by its ``name{labels}`` key (the plain name if unlabelled;
    empty when the page has none)."""
    prefix = name + "{"
    labelled = {k: v for k, v in samples.items() if k.startswith(prefix)}
    return labelled or ({name: samples[name]} if name in samples else {})


@dataclass(frozen=True)
class Balance:
    """A counter an engine also breaks down by source: the sum of ``parts`` over their labels must
    equal ``whole``. The ``counters`` probe judges a shortfall that two reads in a row show."""

    name: str
    whole: str
    parts: str
    meaning: str
    verdict: Verdict


#: engine family -> its balances. vLLM's PromptTokenStats (v1/metrics/stats.py, 0.32.0) states the
#: invariant ``computed + local_cache_hit + external_kv_transfer = total``, and v1/metrics/loggers.py
#: increments both counters from that one record; some releases between add the one recomputed
#: token of a full cache hit to local_cache_hit, so there the parts may exceed the whole, never fall
#: short of it.
ENGINE_BALANCES: dict[str, tuple[Balance, ...]] = {
    "vllm": (
        Balance(
            "prompt_token_sources",
            "vllm:prompt_tokens_total",
            "vllm:prompt_tokens_by_source_total",
            "prompt tokens the engine counted but put down to no source (not computed, not from its "
            "prefix cache, not received over a KV connector): KV of unknown origin under those prompts, "
            "or books that no longer hold",
            Verdict.MISMATCH,
        ),
    ),
}


def balance_gaps(engine: str, samples: dict[str, float]) -> dict[str, dict[str, float]]:
    """Return, per balance of ``engine`` whose two counters ``samples`` has, the whole, the sum of
    its parts and the gap (the whole less the parts: tokens put down to no source)."""
    gaps = {}
    for balance in ENGINE_BALANCES.get(engine, ()):
        if balance.whole in samples and balance.parts in samples:
            whole, parts = samples[balance.whole], samples[balance.parts]
            gaps[balance.name] = {"whole": whole, "parts": parts, "gap": whole - parts}
    return gaps


@dataclass(frozen=True)
class StateGauge:
    """A gauge an engine keeps beside its counters: read as it stands, series by series, and reported
    as evidence (its series off ``sound`` named), never judged on its own."""

    name: str
    sample: str
    meaning: str
    #: What each series of a sound node reads.
    sound: float


#: engine family -> its state gauges.
ENGINE_GAUGES: dict[str, tuple[StateGauge, ...]] = {
    # LMCache's connector inside vLLM (LMCacheConnectorV1) writes its gauges into vLLM's page
    # (lmcache/observability.py ``_dynamic_metrics``, commit 0353be82): both are read at scrape time
    # by a callback, the health one as ``lmcache:lmcache_is_healthy`` (its docs page says
    # ``lmcache:is_healthy``, which no code read registers).
    "vllm": (
        StateGauge(
            "kv_load_error_blocks",
            "lmcache:connector_invalid_block_ids_count",
            "blocks whose KV the connector failed to load, not yet taken by vLLM to recompute (it takes "
            "them every step, so a standing count is an engine not taking them)",
            0.0,
        ),
        StateGauge(
            "kv_offload_healthy",
            "lmcache:lmcache_is_healthy",
            "LMCache's health monitor: 0 while a storage backend fails its checks and LMCache blocks "
            "its operations (requests recompute)",
            1.0,
        ),
    ),
    # The running total on SGLang's canary stats line (mtail's page, as its counters): it counts
    # violations the engine's ring overflowed before they were logged, which the counters miss.
    "sglang": (
        StateGauge(
            "kv_canary_engine_violations",
            "sglang_kv_canary_engine_violations",
            "violations SGLang's KV canary counted since the engine started, as its last stats line said",
            0.0,
        ),
    ),
}


def gauge_readings(engine: str, samples: dict[str, float]) -> list[dict[str, object]]:
    """Return the reading of each state gauge of ``engine`` that ``samples`` has: its value summed,
    and the series off their sound value."""
    readings: list[dict[str, object]] = []
    for gauge in ENGINE_GAUGES.get(engine, ()):
        series = series_of(samples, gauge.sample)
        if series:
            off = {key: value for key, value in series.items() if value != gauge.sound}
            reading = {"gauge": gauge.name, "sample": gauge.sample, "value": sum(series.values())}
            readings.append({**reading, "sound": gauge.sound, "off": off, "meaning": gauge.meaning})
    return readings


#: engine family -> the sample counting requests aborted because their client went away. SGLang's
#: tokenizer manager counts every abort it handles (client disconnects and admission refusals;
#: from its source, not run here). vLLM is not listed: its
#: ``vllm:request_success_total{finished_reason="abort"}`` stayed 0 after 9 client hang-ups on the
#: 0.32 CPU build (``tests/vllm/test_triggers_on_vllm.py``; the output processor's abort path records
#: no finished-request stats), so judging it would page on every run. llama.cpp and hosted APIs
#: count none.
ABORT_COUNTERS: dict[str, str] = {
    "reference": "kvcanary_requests_aborted_total",
    "sglang": "sglang:num_aborted_requests_total",
}


def aborted_requests(engine: str, samples: dict[str, float]) -> float | None:
    """Return the aborts ``samples`` count for ``engine``, or None where the engine exports none."""
    name = ABORT_COUNTERS.get(engine)
    return samples.get(name) if name is not None else None


@dataclass(frozen=True)
class CacheTiers:
    """How an engine counts the prompt tokens its caches served, tier by tier: one counter family
    labelled by the tier that held them."""

    sample: str
    label: str
    #: The tiers, nearest the accelerator first, as the engine names them.
    order: tuple[str, ...]
    #: Label values that name no tier (a total the engine falls back to).
    unattributed: tuple[str, ...] = ()


#: engine family -> its per-tier cached-token counter. vLLM 0.32.0 (v1/metrics/loggers.py,
#: cache_hit_source.py): ``vllm:prompt_tokens_cached_by_source`` by ``source``, counted at admission,
#: every source exported at 0 from the start. SGLang 0.5.23 (observability/metrics_collector.py):
#: ``sglang:cached_tokens_total`` by ``cache_source`` (``device``, ``host``, ``storage`` for HiCache's
#: L3, ``total`` where a request carried no breakdown), each series from its first hit. The reference
#: worker: ``kvcanary_cached_tokens_by_tier_total`` by ``tier`` (docs/worker-metrics.md).
CACHE_TIERS: dict[str, CacheTiers] = {
    "reference": CacheTiers("kvcanary_cached_tokens_by_tier_total", "tier", ("prefix", "session", "offload")),
    "vllm": CacheTiers(
        "vllm:prompt_tokens_cached_by_source_total",
        "source",
        ("device", "host", "p2p", "disk", "external_unspecified"),
    ),
    "sglang": CacheTiers(
        "sglang:cached_tokens_total", "cache_source", ("device", "host", "storage"), unattributed=("total",)
    ),
}
#: What a served token counts under when the engine's series names no tier of its own.
UNATTRIBUTED = "unattributed"


def tier_tokens(engine: str, samples: dict[str, float]) -> dict[str, float] | None:
    """Return the cached tokens ``samples`` count per tier of ``engine`` (a tier with no series yet
    is absent: none served so far), or None where the engine counts none per tier."""
    tiers = CACHE_TIERS.get(engine)
    if tiers is None:
        return None
    found: dict[str, float] = {}
    for key, value in series_of(samples, tiers.sample).items():
        match = re.search(rf'(?:^|[{{,]){re.escape(tiers.label)}="([^"]*)"', key)
        tier = match.group(1) if match is not None else UNATTRIBUTED
        if tier in tiers.unattributed or tier not in tiers.order:
            tier = UNATTRIBUTED
        found[tier] = found.get(tier, 0.0) + value
    return found
