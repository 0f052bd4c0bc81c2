"""The machine's PostgreSQL for tests: started where it is down, a throw-away database per user.

It is the cluster on 127.0.0.1:5432 (``KVCANARY_TEST_PG_PORT`` to move it); nothing fakes it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg

PG_HOST, PG_PORT = "127.0.0.1", int(os.environ.get("KVCANARY_TEST_PG_PORT", "5432"))


def pg_up() -> bool:
    try:
        with socket.create_connection((PG_HOST, PG_PORT), timeout=1):
            return True
    except OSError:
        return False


def start_local_pg() -> None:
    """Start the machine's cluster when it is down (Debian: pg_ctlcluster)."""
    if pg_up() or not shutil.which("pg_ctlcluster"):
        return
    versions = sorted(Path("/etc/postgresql").glob("*"))
    if versions:
        subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1].name, "main", "start"],
            check=False,
            capture_output=True,
            timeout=60,
        )
    for _ in range(50):
        if pg_up():
            return
        time.sleep(0.2)


def own_database(prefix: str) -> Iterator[str]:
    """Yield the URL of a new database on the machine's server and drop it afterwards (a fixture's
    body: ``yield from own_database("kvcanary_stack")``), for tests whose processes need one to
    themselves. Dropped WITH (FORCE): a replica a test killed may still hold connections."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = f"host={PG_HOST} port={PG_PORT} user=postgres dbname=postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://postgres@{PG_HOST}:{PG_PORT}/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
