"""``kvcanary check``: every configured probe once on every target, as a deploy gate.

It needs no database: it judges and prints. Targets run concurrently; the probes of one
target run in their configured order, so markers planted by ``cross_tenant`` are live when
``boundary`` reads whatever stale pages an over-capacity request is given.
"""

from __future__ import annotations

import asyncio
import json

import typer

from kvcanary.monitor.config.secrets import TenantKeys, tenant_keys
from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.runs.coverage import Where, bound_to, nodes_of_run
from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.monitor.targets.openai_format import Limits
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes.base import ProbeResult, Verdict
from kvcanary.probes.markers import MarkerBook

EXIT_OK, EXIT_FAILED, EXIT_UNJUDGED = 0, 1, 3


async def _check_target(
    target: TargetConfig, keys: TenantKeys, markers: MarkerBook, limits: Limits
) -> list[tuple[str, str, ProbeResult]]:
    tenants = {tn.name: keys[(target.name, tn.name)] for tn in target.tenants}
    client = OpenAIHttpTarget(target, tenants, limits=limits, worker_key=keys.workers.get(target.name))
    try:
        rows = []
        for kind in target.probes:
            for where in nodes_of_run(target, kind):
                run_client, node = bound_to(client, where)
                result, _ = await execute_probe(kind, run_client, markers, target, node=node)
                rows.append((_where(target.name, where), kind, result))
        return rows
    finally:
        await client.aclose()


def _where(target: str, where: Where) -> str:
    return f"{target}@{where.name}" if where is not None and where.name else target


async def _check_all(settings: Settings, only: list[str] | None) -> list[tuple[str, str, ProbeResult]]:
    keys = tenant_keys(settings, only)  # a target not checked needs no key
    markers = MarkerBook(ttl_seconds=settings.marker_ttl_seconds)
    targets = [t for t in settings.targets if only is None or t.name in only]
    limits = Limits(**settings.limits.model_dump())
    per_target = await asyncio.gather(*(_check_target(t, keys, markers, limits) for t in targets))
    return [row for rows in per_target for row in rows]


def exit_code(verdicts: list[Verdict]) -> int:
    """Return 1 when anything failed, 3 when errors alone kept a probe from judging (or nothing was
    probed at all: a deploy gate must not pass on no evidence), else 0."""
    if any(v.is_failure for v in verdicts):
        return EXIT_FAILED
    if not verdicts or any(v is Verdict.ERROR for v in verdicts):
        return EXIT_UNJUDGED
    return EXIT_OK


def run_check(settings: Settings, *, json_lines: bool, only: list[str] | None = None) -> int:
    rows = asyncio.run(_check_all(settings, only))
    if not rows:
        typer.echo("nothing was checked: no target (or none named by --target) has a probe", err=True)
    if json_lines:
        for target, probe, result in rows:
            line = {
                "target": target,
                "probe": probe,
                "verdict": result.verdict.value,
                "reason": result.reason,
            }
            if result.detail:
                line["detail"] = result.detail
            typer.echo(json.dumps(line))
    else:
        width = max([len(t) for t, _, _ in rows] + [6])
        typer.echo(f"{'TARGET':<{width}}  {'PROBE':<12}  {'VERDICT':<8}  REASON")
        for target, probe, result in rows:
            typer.echo(
                f"{target:<{width}}  {probe:<12}  {result.verdict.value:<8}  {result.reason}: {result.detail}"
            )
    return exit_code([r.verdict for _, _, r in rows])
