"""``kvcanary blast-radius INCIDENT``: who an incident exposed, for the operator who must notify them.

Reads the monitor's database (the incident, its results, the traffic it recorded) and, named on
the command line or in the configuration, a gateway's log files and LiteLLM's database. The
target is asked once for its tokenizer's count of the monitor's sample text (how many characters
a token holds), so a prompt whose reported count the defect falsified is sized by its length;
``--chars-per-token`` gives the figure where the target cannot be reached.

Exit 0 with a report, 1 when the incident is not found, 2 for a bad configuration or database.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from fastapi.encoders import jsonable_encoder

from kvcanary.monitor.blast.compute import (
    CSV_LIMIT,
    BlastSources,
    as_csv,
    blast_radius,
    configured_sources,
    request_rows,
)
from kvcanary.monitor.blast.report import BlastRadius
from kvcanary.monitor.config.secrets import tenant_keys
from kvcanary.monitor.config.settings import ConfigError, Settings
from kvcanary.monitor.storage.db import check_migrated, make_engine, make_session_factory
from kvcanary.monitor.storage.models import Incident, Target
from kvcanary.monitor.targets.calibration import SAMPLE_TEXT
from kvcanary.monitor.targets.openai_format import Limits
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.monitor.traffic.judge import own_key_digests

EXIT_OK, EXIT_NOT_FOUND = 0, 1


def calibrate(settings: Settings, target: str) -> float | None:
    """Ask the target's tokenizer for its count of the sample text; None when it cannot answer."""
    config = settings.target(target)
    if config is None:
        return None

    async def ask() -> float | None:
        keys = tenant_keys(settings, [target])
        client = OpenAIHttpTarget(config, {t.name: keys[(target, t.name)] for t in config.tenants},
                                  limits=Limits(**settings.limits.model_dump()))  # fmt: skip
        try:
            await asyncio.wait_for(client.count_tokens(SAMPLE_TEXT), timeout=15)
            return client.calibration.chars_per_token
        except Exception:  # an unreachable target only leaves the figure unknown
            return None
        finally:
            await client.aclose()

    return asyncio.run(ask())


def run_blast_radius(
    settings: Settings,
    incident_id: int,
    *,
    logs: list[str],
    log_format: str,
    litellm_db: str | None,
    exclude: list[str],
    chars_per_token: float | None,
    csv_path: Path | None,
    as_json: bool,
    out: TextIO = sys.stdout,
) -> int:
    engine = make_engine(settings.database_url)
    try:
        check_migrated(engine)
        factory = make_session_factory(engine, read_only=True)
        with factory() as session:
            row = session.get(Incident, incident_id)
            if row is None:
                print(f"kvcanary: no incident {incident_id} in this database", file=sys.stderr)
                return EXIT_NOT_FOUND
            target = session.get(Target, row.target_id)
            name = target.name if target is not None else ""
            cpt = chars_per_token if chars_per_token is not None else calibrate(settings, name)
            if cpt is None:
                print(f"kvcanary: {name} did not count the sample text: prompts are sized by their "
                      "reported counts (give --chars-per-token)", file=sys.stderr)  # fmt: skip
            sources = _sources(settings, logs, log_format, litellm_db, exclude, cpt)
            radius = blast_radius(session, incident_id, settings, sources)
            assert radius is not None  # read above, in this session
            if csv_path is not None:
                rows = request_rows(session, radius)
                csv_path.write_text(as_csv(rows, radius), encoding="utf-8")
                print(f"kvcanary: {len(rows)} request id(s) written to {csv_path}", file=sys.stderr)
                _short_list(len(rows), radius)
    finally:
        engine.dispose()
    if as_json:
        json.dump(jsonable_encoder(radius.as_json()), out, indent=1)
        out.write("\n")
    else:
        out.write(text_report(radius))
    return EXIT_OK


def _short_list(listed: int, radius: BlastRadius) -> None:
    """Say so when the CSV lists fewer requests than the report counts, and why."""
    counted = radius.responses or 0
    if listed >= counted:
        return
    if listed >= CSV_LIMIT:
        why = f"the CSV stops at {CSV_LIMIT:,} ids"
    else:
        why = "the traffic the monitor recorded counts these requests by the minute and keeps no id of them"
        why += ": give the gateway's logs (--logs) or its spend log (--litellm-db) for the ids"
    print(f"kvcanary: the CSV lists {listed} of {counted} responses: {why}", file=sys.stderr)


def _sources(
    settings: Settings, logs: list[str], log_format: str, litellm_db: str | None, exclude: list[str],
    cpt: float | None,
) -> BlastSources:  # fmt: skip
    try:
        own = own_key_digests(tenant_keys(settings))
    except ConfigError:
        own = frozenset()  # a tenant's key not set here: its requests are counted as a customer's
        print(
            "kvcanary: not every tenant key is set here: the monitor's own requests may be counted",
            file=sys.stderr,
        )
    return configured_sources(
        settings, own_keys=own, chars_per_token=lambda _target: cpt,
        logs=[(glob, log_format) for glob in logs], litellm_db=litellm_db, exclude=exclude, threads=2,
    )  # fmt: skip


def text_report(radius: BlastRadius) -> str:
    data: dict[str, Any] = radius.as_json()
    lines = [f"Blast radius of incident {radius.incident['id']}: {radius.incident['title']}", ""]
    lines += [f"  {line}" for line in radius.disclosure()]
    if data["note"]:
        lines += ["", f"  {data['note']}"]
    if data["callers"]:
        lines += ["", f"  {'caller':<32} {'responses':>9}  first                 last"]
        for c in data["callers"]:
            name = c["caller"] or "(unnamed)"
            lines.append(f"  {name:<32} {c['responses']:>9}  {c['first'] or '':<21} {c['last'] or ''}")
    lines += ["", "  Sources:"]
    for s in data["sources"]:
        mark = "*" if s["primary"] else " "
        count = "no coverage" if not s["covered"] else f"{s['responses']} response(s)"
        lines.append(f"  {mark} {s['name']}: {count} ({s['read']})")
        lines += [f"      {note}" for note in s["notes"]]
    return "\n".join(lines) + "\n"
