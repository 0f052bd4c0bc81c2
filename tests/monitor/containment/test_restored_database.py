"""A monitor whose database is restored from a backup (``kvcanary serve`` on SQLite, the Python tap
polling it as a gateway does): the gateway refuses the restored, older set and keeps the newer one
it holds, whose quarantine is real; the monitor says its database is older than what the gateways
apply; and the next quarantine change, an operator's, reaches the gateway at once, numbered above
every set signed before the restore (it was the change row's id, which the restored database
handed out again below them: the gateways refused every new quarantine until the ids passed).
"""

from __future__ import annotations

import base64
import json
import shutil
import sqlite3
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import httpx

from kvcanary.tap.containment.watch import QuarantineWatch
from kvcanary.wire import GATEWAY_HEADER, QUARANTINE_HELD_HEADER
from tests.monitor.containment.test_signing_served import INGEST, config
from tests.monitor.served import Served
from tests.support.signing import make_keys

TARGET = "glm"


def change(monitor: Served, quarantined: bool, reason: str) -> None:
    """Put a quarantine on ``glm`` by hand, or lift it (the target's row exists once a run recorded)."""
    path = f"{monitor.url}/api/v1/targets/{TARGET}/quarantine"
    auth = {"Authorization": f"Bearer {monitor.token}"}

    def done() -> bool:
        if quarantined:
            answer = httpx.post(path, json={"reason": reason}, headers=auth, timeout=10)
        else:
            answer = httpx.delete(path, params={"reason": reason}, headers=auth, timeout=10)
        assert answer.status_code in (200, 201, 404), answer.text
        return answer.status_code != 404

    monitor.wait_for(f"the quarantine {'put' if quarantined else 'lifted'} by hand", done, 30)


def reason(watch: QuarantineWatch) -> str:
    """What the gateway holds against ``glm``: the quarantine's reason ("" where none)."""
    return next((e.reason for e in watch.current.enforced.values() if e.target == TARGET), "")


def restore(monitor: Served, database: Path, backup: Path) -> None:
    """Stop the monitor, put the backup in the database's place, start it again."""
    monitor.stop()
    for journal in database.parent.glob(database.name + "-*"):  # -wal, -shm: the backup is whole
        journal.unlink()
    shutil.copy(backup, database)
    monitor.start(migrate=False)


def test_a_restored_database_leaves_the_gateways_set_until_its_next_change_which_they_take(
    served: Callable[..., Served], tmp_path: Path
) -> None:
    keys = make_keys(tmp_path / "keys")
    monitor = served(config(containment_signing=keys.monitor_config()))
    monitor.env["KVC_TEST_INGEST"] = INGEST
    database = Path(monitor.config["database_url"].removeprefix("sqlite:///"))
    backup = tmp_path / "backup.db"
    monitor.start()
    change(monitor, True, "out for maintenance")
    watch = QuarantineWatch(monitor.url, INGEST, keys=keys.public_keys, gateway="gw-east", poll_seconds=0.2)
    try:
        monitor.wait_for("the gateway to take the quarantine", lambda: reason(watch), 15)
        with closing(sqlite3.connect(database)) as live, closing(sqlite3.connect(backup)) as copy:
            live.backup(copy)  # the night's backup, taken while the monitor runs
        change(monitor, False, "maintenance over")
        change(monitor, True, "leaking: taken out again")
        monitor.wait_for("the gateway to take the second quarantine", lambda: "again" in reason(watch), 15)
        held = watch.current
        # A forger with the ingest token claims a revision no monitor reaches, under the monitors'
        # own key id (every set names it): it moves no set and hides no real claim after it.
        forged = {"Authorization": f"Bearer {INGEST}", GATEWAY_HEADER: "gw-forged",
                  QUARANTINE_HELD_HEADER: f"{10**18} {keys.key_id}"}  # fmt: skip
        answer = httpx.get(monitor.url + "/api/v1/quarantine", headers=forged, timeout=10)
        assert answer.status_code == 200, answer.text
        assert json.loads(base64.b64decode(answer.json()["payload"]))["revision"] == held.revision
        time.sleep(1.5)  # three rounds
        assert "the database is older" not in monitor.log()
        assert watch.current.revision == held.revision

        restore(monitor, database, backup)  # the last two changes are gone
        said = lambda: "the database is older than the set the gateways apply" in monitor.log()  # noqa: E731
        monitor.wait_for("the monitor to say its database is older than the gateways' set", said, 30)
        monitor.wait_for("the gateway to refuse the restored set", lambda: watch.refused["older"] >= 1, 10)
        assert watch.current.revision == held.revision and "again" in reason(watch)

        change(monitor, False, "lifted after the restore")
        monitor.wait_for("the gateway to take the lift", lambda: not reason(watch), 15)
        assert watch.current.revision > held.revision
        assert monitor.log().count("the database is older") == 1  # said once
    finally:
        watch.close()
