"""``kvcanary quarantine list|put|lift``: the quarantine set read and changed from a shell, on the
monitor's database (what ``GET /api/v1/quarantine`` and ``POST``/``DELETE
/api/v1/targets/{name}/quarantine`` do over HTTP; ``monitor/containment/rules.py`` has the rules). A
running monitor serves a change to the gateways' taps at their next poll."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.containment.rules import Quarantine, QuarantineRules, UnknownTarget
from kvcanary.monitor.storage.db import check_migrated, make_engine, make_session_factory

EXIT_OK, EXIT_NOTHING = 0, 1


def run_quarantine(
    settings: Settings, action: str, target: str | None, reason: str, out: TextIO = sys.stdout
) -> int:
    """Do ``action`` (``list``, ``put``, ``lift``) and print what stands; raise DatabaseNotMigrated."""
    engine = make_engine(settings.database_url)
    try:
        check_migrated(engine)
        containment = QuarantineRules(make_session_factory(engine), lambda: settings)
        return _act(containment, action, target, reason, out)
    finally:
        engine.dispose()


def _act(containment: QuarantineRules, action: str, target: str | None, reason: str, out: TextIO) -> int:
    if action == "list":
        for entry in containment.current():
            print(_line(entry), file=out)
        return EXIT_OK
    assert target is not None  # the command line asks for one
    change: Callable[[str, str], Quarantine | None] = containment.put if action == "put" else containment.lift
    try:
        done = change(target, reason)
    except UnknownTarget:
        print(f"kvcanary: no target named {target} (configured and with a result recorded)", file=sys.stderr)
        return EXIT_NOTHING
    if done is None:
        print(f"kvcanary: {target} is not quarantined", file=sys.stderr)
        return EXIT_NOTHING
    print(_line(done), file=out)
    return EXIT_OK


def _line(entry: Quarantine) -> str:
    state = "quarantined" if entry.enforced else "observed"
    incident = f" incident {entry.incident_id}" if entry.incident_id is not None else ""
    since = f"since {entry.since:%Y-%m-%d %H:%M:%S}Z"
    return "\t".join((entry.target, state, entry.cause + incident, since, entry.reason))
