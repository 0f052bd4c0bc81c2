"""Run a probe kind several times against a real engine, its state carried as the runner carries it."""

from __future__ import annotations

import asyncio
from typing import Any

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes.base import ProbeResult
from kvcanary.probes.markers import MarkerBook

TENANTS = ("tenant-a", "tenant-b")


def repeated_runs(
    url: str, engine: str, model: str, kind: str, runs: int, options: dict[str, dict[str, Any]]
) -> list[ProbeResult]:
    """Return ``runs`` judged results of ``kind`` against the engine at ``url`` (two keyless tenants)."""
    config = TargetConfig(
        name=f"{engine}-cpu", base_url=url, engine=engine, model=model,
        tenants=[{"name": t} for t in TENANTS], timeout_seconds=60, probes=[kind], options=options,
    )  # fmt: skip

    async def go() -> list[ProbeResult]:
        results: list[ProbeResult] = []
        state: dict[str, Any] = {}
        async with OpenAIHttpTarget(config, dict.fromkeys(TENANTS)) as target:
            for _ in range(runs):
                result, _ = await execute_probe(kind, target, MarkerBook(), config, state=state)
                state = result.state if result.state is not None else state
                results.append(result)
        return results

    return asyncio.run(go())
