"""The rig of ``bench/jetstream.py``: its own ``nats-server``, throw-away PostgreSQL databases,
``kvcanary serve`` processes, the real tap publishing at a steady rate, and the readings the figures
are made of (a process's CPU from ``/proc``, judged ids and their times from the database).
Everything binds to 127.0.0.1; everything started is stopped by its owner."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402  (run as a script from the repository)
import nats  # noqa: E402
import nats.js.errors  # noqa: E402
import psycopg  # noqa: E402
import yaml  # noqa: E402

from kvcanary.processes import wait_until  # noqa: E402
from kvcanary.tap import Tap  # noqa: E402
from kvcanary.tap.jetstream import JetStreamTransport  # noqa: E402
from kvcanary.tap.record import Exchange  # noqa: E402
from kvcanary.tap.transport import Batch  # noqa: E402
from tests.support import free_port, stop_process  # noqa: E402  (as bench/tap_litellm.py does)
from tests.support.jetstream import StreamNames, replica_config  # noqa: E402

KEY = b"bench-fingerprint-key-0123456789"
TOKEN = "bench-token-0123456789abcdef"
PARTITIONS = 16
MAX_BYTES = 64 * 1024**2
BASES = [f"http://10.2.0.{i}:8000/v1" for i in range(1, 25)]
CALLERS = 8
TEXT = "\n".join(
    p.read_text(errors="replace") for p in sorted(Path("/usr/share/common-licenses").glob("*")) if p.is_file()
)
CLOCK_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid``, every thread of it (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK  # utime, stime: fields 14 and 15


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def until(what: str, check: Callable[[], Any], timeout: float, every: float = 0.1) -> Any:
    return wait_until(what, check, timeout, every=every)


def exchange(record_id: str, i: int) -> Exchange:
    """A 1 KB exchange: 700 characters of a licence asked, and 300 of them quoted back (benign:
    the caller's own text), from one of ``CALLERS`` callers to one of ``BASES``."""
    at = (i * 7919) % (len(TEXT) - 1000)
    prompt = TEXT[at : at + 700]
    return Exchange(
        record_id, time.time(), f"team-{i % CALLERS}", "team", BASES[i % len(BASES)], model="m",
        prompt=prompt, messages=2, response="Here it is: " + prompt[100:400], prompt_tokens=180,
        completion_tokens=80, latency_seconds=0.4,
    )  # fmt: skip


# --- NATS, PostgreSQL and the monitor as processes -------------------------------------------------


def new_names() -> StreamNames:
    """A stream, bucket and subject prefix of the bench's own (deleted after it)."""
    tag = uuid.uuid4().hex[:10]
    return StreamNames(f"KVC_BENCH_{tag}", f"kvc_bench_{tag}", f"kvcbench.{tag}")


async def connected(url: str) -> nats.NATS:
    return await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=1, connect_timeout=2)


class Database:
    """A PostgreSQL database of one part's own, created now and dropped by :meth:`drop`."""

    def __init__(self, host: str, port: int):
        self.name = f"kvcanary_bench_{uuid.uuid4().hex[:8]}"
        self.admin = f"host={host} port={port} user=postgres dbname=postgres"
        with psycopg.connect(self.admin, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.name}"')
        self.url = f"postgresql+psycopg://postgres@{host}:{port}/{self.name}"
        self.conn = psycopg.connect(
            f"host={host} port={port} user=postgres dbname={self.name}", autocommit=True
        )

    def judged(self, prefix: str) -> int:
        row = self.conn.execute(
            "SELECT count(*) FROM traffic_judged WHERE record_id LIKE %s", (prefix + "%",)
        )
        return int(row.fetchone()[0])  # type: ignore[index]

    def judged_at(self, prefix: str) -> dict[str, float]:
        """Each judged id of ``prefix``: when it was judged (epoch seconds)."""
        rows = self.conn.execute(
            "SELECT record_id, extract(epoch FROM judged_at)::float8 FROM traffic_judged "
            "WHERE record_id LIKE %s",
            (prefix + "%",),
        )
        return {r: float(t) for r, t in rows}

    def minute_counts(self) -> tuple[int, int]:
        """(records counted per minute, of them flagged), every judged record adding one."""
        row = self.conn.execute(
            "SELECT coalesce(sum(records), 0), coalesce(sum(flagged), 0) FROM traffic_minute"
        ).fetchone()
        return int(row[0]), int(row[1])  # type: ignore[index]

    def drop(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()
        with psycopg.connect(self.admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


def monitor_config(database_url: str, names: StreamNames, nats_url: str, ack_wait: float) -> dict[str, Any]:
    """A replica's config over the bench's deployments (the tests' config, the bench's stream)."""
    return replica_config(
        database_url, names, BASES, nats_url, partitions=PARTITIONS, max_bytes=MAX_BYTES,
        ack_wait_seconds=ack_wait, duplicate_window_seconds=max(900, 2 * ack_wait),
    )  # fmt: skip


class Monitor:
    """One ``kvcanary serve`` process in its own folder (config, spool, state, log)."""

    def __init__(self, folder: Path, config: dict[str, Any]):
        folder.mkdir(parents=True)
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            **config,
            "spool": {"path": str(folder / "spool")},
            "api": {"listen": f"127.0.0.1:{self.port}"},
        }
        self.config_path = folder / "kvcanary.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = folder / "monitor.log"
        self.env = {**os.environ, "KVCANARY_API_TOKEN": TOKEN, "KVCANARY_STATE_DIR": str(folder / "state")}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, migrate: bool) -> Monitor:
        command = [sys.executable, "-m", "monitor"]
        if migrate:
            done = subprocess.run(
                [*command, "db", "upgrade", "--config", str(self.config_path)],
                cwd=REPO, env=self.env, capture_output=True, text=True, timeout=180,
            )  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"kvcanary db upgrade failed: {done.stderr[-2000:]}")
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                [*command, "serve", "--config", str(self.config_path)],
                cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        until("kvcanary serve to answer /healthz", self.report, 120, 0.25)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def report(self) -> dict[str, Any]:
        """The stream part of ``/healthz`` ({} while it does not answer)."""
        if self.proc is None or self.proc.poll() is not None:
            if self.proc is not None and self.proc.returncode not in (None, -signal.SIGKILL):
                raise RuntimeError(f"kvcanary serve exited with {self.proc.returncode}:\n{self.log()}")
            return {}
        try:
            answer = httpx.get(self.url + "/healthz", timeout=5)
            return dict(answer.json().get("traffic_stream", {}))
        except (httpx.HTTPError, ValueError):
            return {}

    def partitions(self) -> list[int]:
        return list(self.report().get("partitions", []))

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=20)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""


class Traffic(threading.Thread):
    """Hands exchanges to the real tap at ``rate`` a second, noting when each was handed over
    (``observed``) and when JetStream acknowledged its publish (``published``: the tap's transport,
    wrapped, notes the time its ``send`` returned for the records it took)."""

    def __init__(self, tap: Tap, prefix: str, rate: float, limit: int):
        super().__init__(name="bench-traffic", daemon=True)
        self.tap, self.prefix, self.rate, self.limit = tap, prefix, rate, limit
        self.observed: dict[str, float] = {}
        self.published: dict[str, float] = {}
        self.halt = threading.Event()
        transport = tap.sender.transport
        send = transport.send

        def timed(batch: Batch) -> tuple[int, int]:
            named_by_exchange(batch.records)
            taken, refused = send(batch)
            now = time.time()
            for record in batch.records[:taken]:
                self.published[record["id"]] = now
            return taken, refused

        transport.send = timed  # type: ignore[method-assign]  # the Sender calls it on its thread

    def run(self) -> None:
        began = time.monotonic()
        for i in range(self.limit):
            if self.halt.is_set():
                return
            wait = began + i / self.rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            record_id = f"{self.prefix}{i}"
            self.observed[record_id] = time.time()
            self.tap.observe(exchange(record_id, i))

    def stop(self) -> None:
        self.halt.set()
        self.join(10)


def named_by_exchange(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give each record its exchange's id (the bench's ``<prefix><i>``, unique in the run) as its
    identity, in place: the tap makes an id of its own (``tap-`` and random digits), and the figures
    find each record's judging time in ``traffic_judged`` by the part's prefix and the exchange."""
    for record in records:
        record["id"] = record.get("upstream_id") or record["id"]
    return records


def new_tap(nats_url: str, names: StreamNames) -> Tap:
    """The real tap as ``KVCANARY_TAP_URL=nats://...`` makes it, the Sender's defaults unchanged."""
    return Tap(
        nats_url, None, KEY, gateway="bench", partitions=PARTITIONS, subject_prefix=names.subject_prefix
    )


_CLOSED: set[int] = set()


def close_tap(tap: Tap, timeout: float) -> None:
    """Close ``tap`` once: its JetStream sink's second close raises (its event loop is closed)."""
    if id(tap) not in _CLOSED:
        _CLOSED.add(id(tap))
        tap.close(timeout)


# --- the three figures ----------------------------------------------------------------------------


def publish_all(transport: JetStreamTransport, records: list[dict[str, Any]], timeout: float) -> None:
    """Publish ``records`` in batches of 200, each once acknowledged (the rest of a batch again)."""
    deadline = time.monotonic() + timeout
    at = 0
    while at < len(records):
        if time.monotonic() > deadline:
            raise TimeoutError(f"JetStream took {at} of {len(records)} records in {timeout:.0f}s")
        taken, _ = transport.send(Batch(uuid.uuid4().hex, "bench", 0, records[at : at + 200]))
        at += taken
        if not taken:
            time.sleep(0.2)  # the stream full of unjudged records: the monitor is behind
