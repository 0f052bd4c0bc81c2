"""One run of one probe, as the runner and ``kvcanary check`` do it: the budget, a crash turned into
an ``error`` verdict, the final leak judgement over every response (:func:`probes.base.judge`), the
engine's words made plain and bounded, and the tokens it spent. Probes only compute.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.probes import REGISTRY
from kvcanary.probes.base import ProbeContext, ProbeResult, judge
from kvcanary.probes.markers import MarkerBook
from kvcanary.probes.target import Node, TargetClient
from kvcanary.probes.untrusted import plain, word

log = logging.getLogger("kvcanary.runner")

#: A result's detail, as stored (``monitor/storage/result_rows.py`` keeps as many).
DETAIL_CHARS = 2000


async def execute_probe(
    kind: str,
    client: TargetClient,
    markers: MarkerBook,
    target: TargetConfig,
    *,
    node: Node | None = None,
    state: dict[str, Any] | None = None,
    on_cancelled: Callable[[ProbeResult, float], None] | None = None,
    budget: float | None = None,
) -> tuple[ProbeResult, float]:
    """Run probe ``kind`` once (on ``node`` for node-scoped kinds); return its judged result and its
    duration. Never raise, except CancelledError: then ``on_cancelled`` gets what the run had found
    before it was cancelled (a leak or a dropped prompt is judged from the answers already read).
    The tokens the run spent are added to the result's measurements. ``budget`` (seconds) replaces
    the kind's own (``budget_timeouts`` times the target's timeout)."""
    probe = REGISTRY[kind]()
    ctx = ProbeContext(client, markers, options=target.options.get(kind, {}), node=node, state=state)
    started = time.monotonic()
    if budget is None:
        budget = target.timeout_seconds * probe.budget_timeouts
    ctx.deadline = asyncio.get_running_loop().time() + budget
    try:
        result = await asyncio.wait_for(probe.run(ctx), timeout=budget)
    except asyncio.CancelledError:
        if on_cancelled is not None:
            cut = ProbeResult.error("cancelled", f"the {kind} run was cancelled (shutdown) before it ended")
            on_cancelled(judge(cut, ctx), time.monotonic() - started)
        raise
    except TimeoutError:
        result = ProbeResult.error("probe_timeout", f"the probe took longer than its budget on {target.name}")
    except Exception as exc:  # a probe bug is an error verdict, never a crash of the service
        log.exception("probe %s crashed on %s", kind, target.name)
        result = ProbeResult.error("probe_crashed", f"{type(exc).__name__} in the {kind} probe")
    result = judge(result, ctx)
    # A detail may quote what the engine wrote; every sink after this one (rows, titles, pages,
    # annotations, the terminal, logs) gets it plain and bounded.
    result.reason, result.detail = word(result.reason), plain(result.detail, DETAIL_CHARS)
    result.measurements.update(
        prompt_tokens_spent=ctx.tokens["prompt"], completion_tokens_spent=ctx.tokens["completion"]
    )
    return result, time.monotonic() - started
