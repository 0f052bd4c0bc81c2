"""What each engine calls the counters kvcanary judges: one table, per engine family.

The canonical names are those of the reference worker's contract (``docs/worker-metrics.md``).
For every other engine a counter maps to the sample names that engine really exports (read in
its source or scraped from it; see ``tests/fixtures/engines/README.md``), or to nothing: an
empty tuple means "not exposed by this engine", which the ``counters`` probe reports as such and
never reads as a pass. Names are sample names as scraped (``_total`` included); a counter with
labels (``reason``, ``code``) is summed over them.
"""

from __future__ import annotations

from dataclasses import dataclass

from probes.base import Verdict


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
    Canonical("kv_transfer_failures", "disaggregated KV transfers that failed"),
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
        "kv_transfer_failures": (),
        "prefix_cache_queries": ("kvcanary_prefix_cache_queries_total",),
        "prefix_cache_hits": ("kvcanary_prefix_cache_hits_total",),
        "preemptions": (),
    },
    # vLLM v1 (0.32 CPU build scraped in tests/fixtures/metrics/vllm.txt; corrupted_requests only
    # with VLLM_COMPUTE_NANS_IN_LOGITS). No page-ownership or placeholder counter exists.
    "vllm": {
        "ownership_violations": (),
        "placeholder_substitutions": (),
        "pages_reused_dirty": (),
        "corrupted_requests": ("vllm:corrupted_requests_total",),
        "ownership_checks": (),
        "admission_rejections": ("vllm:admission_rejections_total",),
        "kv_transfer_failures": ("vllm:nixl_num_failed_transfers_total",),  # NixlConnector only
        "prefix_cache_queries": ("vllm:prefix_cache_queries_total",),
        "prefix_cache_hits": ("vllm:prefix_cache_hits_total",),
        "preemptions": ("vllm:num_preemptions_total",),
    },
    # SGLang's srt/metrics/collector.py (2026, commit 00ae9c15): PD transfer and bootstrap failures,
    # retractions; nothing on page owners (tests/fixtures/engines/README.md).
    "sglang": {
        "ownership_violations": (),
        "placeholder_substitutions": (),
        "pages_reused_dirty": (),
        "corrupted_requests": (),
        "ownership_checks": (),
        "admission_rejections": (),
        "kv_transfer_failures": (
            "sglang:num_transfer_failed_reqs_total",
            "sglang:num_bootstrap_failed_reqs_total",
        ),
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
        "kv_transfer_failures": (),
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
