"""Capacity: does each node's KV pool hold what its context window promises? Zero requests sent.

Targets the incident's configuration: a node whose KV pool is smaller than its advertised context
window, so a prompt can fit the window and not the pool. It compares two numbers the node states
about itself (see ``monitor/targets/capacity.py``), on every node, on a clock and at every
configuration change.

Verdicts: a pool below the window is a ``mismatch``; one below ``headroom`` times it (default 2.0) a
``pass`` with reason ``headroom_below_target``; a window or pool the node does not publish an
``error``, never a pass. A decode pool is reported, not judged: it holds running sequences, not one
prompt against the window. A prefill or decode node also says whether it checksums its KV hand-offs,
reported beside the pool's verdict (off is a ``mismatch`` only under ``require_kv_checksum``). Every
run fingerprints the node's configuration; a change re-runs the deployment audits.

Judging rules, the hand-off checksum and the fingerprint in full: ``docs/detection.md``, "Probe
contracts in full".
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import Field

from kvcanary.probes.base import Probe, ProbeContext, ProbeOptions, ProbeResult, Verdict
from kvcanary.probes.target import ServerCapacity

#: The pool size the fixed deployment chose: about twice the context window.
DEFAULT_HEADROOM = 2.0
#: The server argument by which a PD node states whether it checksums its KV hand-offs (SGLang's;
#: the reference PD servers state it as SGLang does).
KV_CHECKSUM_FACT = "disaggregation_enable_kv_checksum"


class CapacityOptions(ProbeOptions):
    headroom: float = Field(DEFAULT_HEADROOM, ge=1.0, le=1000.0)
    # What the node does not publish, or publishes wrongly, as the operator knows it.
    context_window: int | None = Field(None, ge=1)
    kv_pool_tokens: int | None = Field(None, ge=1)
    # A prefill or decode node must checksum its KV hand-offs: without it, a mismatch.
    require_kv_checksum: bool = False


class CapacityProbe(Probe):
    """Compare every KV pool of a node with the context window it advertises."""

    kind = "capacity"
    judges_pool = True
    exports_node_capacity = True
    scope = "node"
    options_model = CapacityOptions
    # Cheap (one lookup, no completion) and the first to see a changed node: run it often.
    default_interval_seconds = 60.0

    async def probe(self, ctx: ProbeContext) -> ProbeResult:
        node = ctx.node or ctx.target.nodes[0]
        found = await ctx.target.node_capacity(node)
        window = ctx.options.get("context_window") or found.context_window
        stated_pool = ctx.options.get("kv_pool_tokens")
        role = node_role(node.role, found.disaggregation_mode)
        pools = {"stated": int(stated_pool)} if stated_pool else dict(found.pools)
        if not pools and found.kv_pool_tokens:
            pools = {role: found.kv_pool_tokens}
        evidence = _evidence(node.name, role, found, window, pools)
        if role != node.role:
            evidence["configured_role"] = node.role
        checksum = kv_checksum_state(role, found)
        required = bool(ctx.options.get("require_kv_checksum", False))
        if role == "decode" and pools:
            figures = with_checksum(decode_figures(window, pools, evidence), checksum, required)
            return _with_fingerprint(figures, configuration(found), ctx.state)
        missing = [name for name, value in (("context window", window), ("KV pool", pools)) if not value]
        if missing or window is None:
            detail = f"{' and '.join(missing)} not published by {node.info_url} (looked at {found.source})"
            return ProbeResult(Verdict.ERROR, "capacity_unknown", detail, evidence)
        judged = {name: tokens for name, tokens in pools.items() if name != "decode"} or pools
        headroom = float(ctx.options.get("headroom", DEFAULT_HEADROOM))
        result = judge_capacity(window, judged, headroom, evidence)
        # Every pool is exported, the decode pool beside the judged ones (the alert tells them apart).
        result.measurements.update({f"pool_tokens.{name}": tokens for name, tokens in pools.items()})
        result.evidence["pools"] = pools
        return _with_fingerprint(with_checksum(result, checksum, required), configuration(found), ctx.state)


def node_role(configured: str, stated: str | None) -> str:
    """Return the node's role: as the engine states it (``disaggregation_mode`` prefill, decode, or
    SGLang's "null" for neither), else as configured or found from its gateway."""
    if stated in ("prefill", "decode"):
        return stated
    return "aggregated" if stated == "null" else configured


def kv_checksum_state(role: str, found: ServerCapacity) -> str | None:
    """Return whether a prefill or decode node checksums its KV hand-offs: ``on``, ``off``, or
    ``unknown`` where it does not say; None for a node that hands nothing to another (aggregated, or
    holding both pools itself)."""
    if role not in ("prefill", "decode") or {"prefill", "decode"} <= set(found.pools):
        return None
    stated = found.facts.get(KV_CHECKSUM_FACT)
    if stated is None:
        return "unknown"
    return "on" if stated.strip().lower() in ("true", "1") else "off"


def with_checksum(result: ProbeResult, state: str | None, required: bool) -> ProbeResult:
    """Return ``result`` with what the node said of its hand-off checksum (module docstring): in the
    evidence, a measurement and the detail; the verdict changes only when it is ``required``."""
    if state is None:
        return result
    said = {"state": state, "setting": KV_CHECKSUM_FACT, "required": required}
    result.evidence["kv_transfer_checksum"] = said
    if state != "unknown":
        result.measurements["kv_transfer_checksum_enabled"] = 1.0 if state == "on" else 0.0
    if state == "off":
        result.detail += (
            f"; its KV hand-offs are not checksummed ({KV_CHECKSUM_FACT} false): K/V corrupted on the way "
            "is decoded, not refused"
        )
        if required and result.verdict is not Verdict.MISMATCH:
            result.evidence["capacity_reason"] = result.reason
            result.verdict, result.reason = Verdict.MISMATCH, "kv_transfer_unverified"
    elif state == "unknown" and required and result.verdict is Verdict.PASS:
        result.evidence["capacity_reason"] = result.reason
        result.verdict, result.reason = Verdict.ERROR, "kv_transfer_checksum_unknown"
        result.detail += (
            f"; the node does not say whether its KV hand-offs are checksummed ({KV_CHECKSUM_FACT})"
        )
    return result


def decode_figures(window: int | None, pools: dict[str, int], evidence: dict[str, Any]) -> ProbeResult:
    """Return a decode node's pools as figures, unjudged (module docstring): a pass that says so."""
    measurements: dict[str, float] = {f"pool_tokens.{name}": tokens for name, tokens in pools.items()}
    shown = ", ".join(f"{name} pool {tokens:,} tokens" for name, tokens in pools.items())
    if window is not None:
        measurements["context_window_tokens"] = window
        shown += f" (context window {window:,})"
    detail = f"{shown}: a decode node's pool holds running sequences and is not judged against the window"
    return ProbeResult(Verdict.PASS, "decode_pool_not_judged", detail, evidence, measurements)


def judge_capacity(
    window: int, pools: dict[str, int], headroom: float, evidence: dict[str, Any]
) -> ProbeResult:
    """Return the verdict on ``pools`` against ``window``; figures go into measurements and evidence."""
    ratios = {name: tokens / window for name, tokens in pools.items()}
    tightest = min(ratios, key=lambda name: ratios[name])
    ratio = ratios[tightest]
    measurements: dict[str, float] = {"context_window_tokens": window, "headroom_ratio": round(ratio, 4)}
    measurements.update({f"pool_tokens.{name}": tokens for name, tokens in pools.items()})
    evidence.update(ratios={k: round(v, 4) for k, v in ratios.items()}, headroom_target=headroom)
    figures = (
        f"{tightest} pool {pools[tightest]:,} tokens against a context window of {window:,} ({ratio:.2f}x)"
    )
    if ratio < 1:
        detail = f"{figures}: a request inside the window does not fit the pool"
        return ProbeResult(Verdict.MISMATCH, "pool_below_context_window", detail, evidence, measurements)
    if ratio < headroom:
        detail = f"{figures}: below the {headroom:g}x headroom target"
        return ProbeResult(Verdict.PASS, "headroom_below_target", detail, evidence, measurements)
    return ProbeResult(Verdict.PASS, "headroom_ok", f"{figures}", evidence, measurements)


def configuration(found: ServerCapacity) -> dict[str, str]:
    """Return what the node states about its configuration, flat and as strings: what a change is of."""
    config = {f"fact.{k}": v for k, v in found.facts.items()}
    config.update({f"pool.{k}": str(v) for k, v in found.pools.items()})
    for name in (
        "context_window",
        "kv_pool_tokens",
        "max_req_input_len",
        "page_size",
        "disaggregation_mode",
        "version",
    ):
        value = getattr(found, name)
        if value is not None:
            config[name] = str(value)
    return config


def fingerprint(config: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def _with_fingerprint(result: ProbeResult, config: dict[str, str], previous: dict[str, Any]) -> ProbeResult:
    """Keep the node's configuration in state; say what changed since the previous run, if anything."""
    now = fingerprint(config)
    result.state = {"fingerprint": now, "config": config}
    before = previous.get("config")
    if isinstance(before, dict) and previous.get("fingerprint") not in (None, now):
        changed = {k: [before.get(k), config.get(k)] for k in sorted(set(before) | set(config))
                   if before.get(k) != config.get(k)}  # fmt: skip
        result.evidence["config_change"] = {
            "before": previous["fingerprint"],
            "after": now,
            "changed": changed,
        }
        result.measurements["config_changed"] = 1
        result.detail += f"; configuration changed ({', '.join(list(changed)[:6])})"
    result.evidence["fingerprint"] = now
    return result


def _evidence(
    node: str, role: str, found: ServerCapacity, window: int | None, pools: dict[str, int]
) -> dict[str, Any]:
    return {
        "node": node,
        "role": role,
        "context_window": window,
        "pools": pools,
        "max_req_input_len": found.max_req_input_len,
        "disaggregation_mode": found.disaggregation_mode,
        "version": found.version,
        "source": found.source,
    }
