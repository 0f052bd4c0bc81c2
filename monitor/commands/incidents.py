"""``kvcanary incidents confirm|dismiss ID``: an operator's word on a suspected incident, from a
shell on the monitor's database (what ``POST /api/v1/incidents/{id}/confirm`` and ``.../dismiss``
do over HTTP; ``monitor/incidents.py`` has the rules). A running monitor's containment takes a
confirmation up at its next round, within a second."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from typing import TextIO

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.incidents import NotSuspected, confirm, dismiss
from kvcanary.monitor.storage.db import check_migrated, make_engine, make_session_factory

EXIT_OK, EXIT_REFUSED = 0, 1
ACTIONS = {"confirm": confirm, "dismiss": dismiss}


def run_incident_word(
    settings: Settings, action: str, incident_id: int, note: str, out: TextIO = sys.stdout
) -> int:
    """Confirm or dismiss the incident; print what it became, or why not. Raise DatabaseNotMigrated."""
    engine = make_engine(settings.database_url)
    try:
        check_migrated(engine)
        with make_session_factory(engine)() as session, session.begin():
            ACTIONS[action](session, incident_id=incident_id, note=note, now=datetime.now(UTC))
    except NotSuspected as exc:
        print(f"kvcanary: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    finally:
        engine.dispose()
    became = "confirmed: containment acts on it" if action == "confirm" else "dismissed: resolved as benign"
    print(f"incident {incident_id} {became}", file=out)
    return EXIT_OK
