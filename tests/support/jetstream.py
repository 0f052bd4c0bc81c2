"""NATS JetStream for the tests: the machine's server (127.0.0.1:4222, started before every session)
or one of a test's own (``nats-server -js`` on a free port, stopped and started under a tap), and
names of streams, buckets and subjects unique to a test, deleted after it; and the two ends of the
stream as the monitor's tests use them: the real tap's sender, and a monitor's pipeline in process."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import nats
from prometheus_client import CollectorRegistry
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.config.settings import JetStreamConfig, Settings
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.storage.db import make_engine, make_session_factory, upgrade
from kvcanary.monitor.storage.models import TrafficJudged, TrafficMinute
from kvcanary.monitor.storage.target_rows import upsert_targets
from kvcanary.monitor.traffic.judge import TrafficJudge
from kvcanary.monitor.traffic.pipeline import TrafficPipeline
from kvcanary.probes.markers import MarkerBook
from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.jetstream import JetStreamTransport
from kvcanary.tap.record import Exchange
from kvcanary.tap.sender import Sender
from kvcanary.wire import partition_of
from tests.support import free_port

if TYPE_CHECKING:
    from tests.monitor.served import Served

T = TypeVar("T")

NATS_URL = "nats://127.0.0.1:4222"
NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"
#: A test stream's size (``StreamNames.config``).
TEST_MAX_BYTES = 64 * 1024**2


@dataclass(frozen=True)
class StreamNames:
    """One test's stream, bucket and subject prefix (the rest of ``traffic.jetstream`` as given)."""

    stream: str
    bucket: str
    subject_prefix: str
    quarantine_bucket: str

    def config(self, url: str = NATS_URL, **fields: Any) -> dict[str, Any]:
        """The ``traffic.jetstream`` block of a config file. Its stream holds ``TEST_MAX_BYTES``
        unless told: NATS reserves a stream's max_bytes on its disk, so tests in parallel (and a
        stream a killed run left behind) at the default 8 GiB would exhaust it for everyone."""
        return {"url": url, "stream": self.stream, "bucket": self.bucket,
                "subject_prefix": self.subject_prefix, "quarantine_bucket": self.quarantine_bucket,
                "max_bytes": TEST_MAX_BYTES, **fields}  # fmt: skip

    def settings(self, url: str = NATS_URL, **fields: Any) -> JetStreamConfig:
        return JetStreamConfig.model_validate(self.config(url, **fields))


def new_names() -> StreamNames:
    tag = uuid.uuid4().hex[:10]
    return StreamNames(f"KVC_TEST_{tag}", f"kvc_test_{tag}", f"kvctest.{tag}", f"kvc_testq_{tag}")


def delete_created(names: StreamNames, url: str = NATS_URL) -> None:
    """Delete the stream and the bucket ``names`` made, where they exist."""

    async def delete() -> None:
        client = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=1, connect_timeout=2)
        js = client.jetstream(timeout=5)
        with contextlib.suppress(Exception):
            await js.delete_stream(names.stream)
        for bucket in (names.bucket, names.quarantine_bucket):
            with contextlib.suppress(Exception):
                await js.delete_key_value(bucket)
        await client.close()

    with contextlib.suppress(Exception):  # the server is down already: its store goes with the test
        asyncio.run(delete())


def names_deleted_after() -> Iterator[StreamNames]:
    """Names for one test on the machine's NATS, deleted after it (a fixture's body)."""
    names = new_names()
    yield names
    delete_created(names)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class OwnNats:
    """A ``nats-server -js`` of one test, on a free loopback port, its store in ``store``: stopped
    and started again (the same port and store) as a real NATS restart."""

    def __init__(self, store: Path, max_payload: int | None = None):
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.store = store
        self.max_payload = max_payload  # None: the server's default (1 MB)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OwnNats:
        args = [NATS_SERVER, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store)]
        if self.max_payload is not None:  # a setting of the configuration file only
            self.store.mkdir(parents=True, exist_ok=True)
            config = self.store.parent / f"nats-{self.port}.conf"
            config.write_text(f"max_payload: {self.max_payload}\n")
            args += ["-c", str(config)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while not _answers(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nats-server on {self.port} did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


def own_server(store: Path, max_payload: int | None = None) -> Iterator[OwnNats]:
    """A NATS server of one test's own (not started: the test starts it), stopped after it."""
    server = OwnNats(store, max_payload)
    yield server
    server.stop()


# --- the two ends, as the monitor's tests use them ----------------------------------------------

KEY = b"a-test-fingerprint-key-0123456789"
BASE = "http://127.0.0.1:30000/v1"


def exchange(i: int, base: str = BASE) -> Exchange:
    text = f"customer {i} asks about the warranty of a charger, politely"
    return Exchange(f"req-{i}-{uuid.uuid4().hex[:6]}", time.time(), f"team-{i % 3}", "team", base,
                    prompt=text, response="Noted, thank you.")  # fmt: skip


def tap(names: StreamNames, url: str = NATS_URL, **kw: Any) -> Sender:
    """The real tap's sender, publishing to ``url`` (the machine's NATS)."""
    transport = JetStreamTransport(url, None, partitions=16, subject_prefix=names.subject_prefix)
    return Sender(url, "", Fingerprinter(KEY), gateway="gw-1", flush_seconds=0.05, transport=transport, **kw)


def counted(factory: sessionmaker[Session]) -> tuple[int, int]:
    """(records judged by the minute counts, judged ids kept)."""
    with factory() as s:
        records = s.scalar(select(func.coalesce(func.sum(TrafficMinute.records), 0)))
        return int(records or 0), int(s.scalar(select(func.count()).select_from(TrafficJudged)) or 0)


def in_process(
    tmp_path: Path, cfg: JetStreamConfig, port: Any = None
) -> tuple[sessionmaker[Session], TrafficPipeline]:
    """A monitor's traffic pipeline on a SQLite file of the test's own, judging one target (``BASE``);
    ``port``: where results go (None: nowhere)."""
    url = f"sqlite:///{tmp_path / 'kvcanary.db'}"
    upgrade(url)
    factory = make_session_factory(make_engine(url))
    settings = Settings.model_validate({
        "targets": [{"name": "glm-prod", "base_url": BASE, "engine": "sglang", "model": "glm",
                     "tenants": [{"name": "alice"}, {"name": "bob"}], "probes": ["canary"]}],
        "traffic": {"source": "jetstream", "jetstream": cfg.model_dump(mode="json")},
    })  # fmt: skip
    with factory.begin() as s:
        upsert_targets(s, [("glm-prod", "sglang", BASE, "glm")], datetime.now(UTC))
    judge = TrafficJudge(settings, {}, MarkerBook(), MonitorMetrics(CollectorRegistry()))
    return factory, TrafficPipeline(judge, port, factory, cfg.partitions)


async def until(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def within(seconds: float, work: Coroutine[Any, Any, T]) -> T:
    """Return ``work``'s result; after ``seconds``, raise AssertionError saying where each task of
    the loop waits (``asyncio.wait_for`` raises a bare TimeoutError, which names nothing)."""
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        task.cancel()
        where = "\n".join(map(_waits_at, others))
        raise AssertionError(f"not done within {seconds:g} s; its tasks wait at:\n{where}")
    return task.result()


def _waits_at(task: asyncio.Task[Any]) -> str:
    """Return a task's name and where it waits: each coroutine it awaits, down to the innermost
    (``Task.get_stack`` shows only the outermost of a suspended task)."""
    frames, awaited = [], task.get_coro()
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if frame is not None:
            frames.append(f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})")
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return f"  {task.get_name()}: {' > '.join(frames) or 'not running'}"


class Port:
    """The recording port's seam: what was handed to it."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    async def submit(self, item: Any) -> None:
        self.items.append(item)


# --- replicas, as `kvcanary serve` processes ------------------------------------------------------


def replica_config(
    database_url: str, names: StreamNames, bases: list[str], url: str = NATS_URL, **stream: Any
) -> dict[str, Any]:
    """A ``kvcanary serve`` config judging ``bases``' traffic from ``names``' stream at ``url``
    (``stream``: more of ``traffic.jetstream``, over the tests' short ack wait and window)."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: the judge reads no facts, quickly
    targets = [
        {"name": f"t{i:02d}", "base_url": dead, "engine": "reference", "model": "m",
         "tenants": [{"name": "a"}, {"name": "b"}], "probes": ["canary"], "interval_seconds": 3600,
         "gateway_api_bases": [base]}
        for i, base in enumerate(bases)
    ]  # fmt: skip
    jetstream = names.config(url, **{"ack_wait_seconds": 3, "duplicate_window_seconds": 30, **stream})
    return {"database_url": database_url, "targets": targets,
            "traffic": {"source": "jetstream", "jetstream": jetstream}}  # fmt: skip


def stream_report(monitor: Served) -> dict[str, Any]:
    try:
        answer = httpx.get(monitor.url + "/healthz", timeout=5)
    except httpx.HTTPError:
        return {}
    return dict(answer.json().get("traffic_stream", {}))


def shares(total: int) -> list[list[int]]:
    """Every split of ``total`` partitions between two replicas that gives each some."""
    return [[k, total - k] for k in range(1, total)]


def bases_covering(partitions: int) -> list[str]:
    """Return 24 deployments' api_bases, and more until every partition holds one: whichever share
    each replica settles on, both have records to judge."""
    bases = [f"http://10.2.0.{i}:8000/v1" for i in range(1, 25)]
    covered = {partition_of(base, partitions) for base in bases}
    host = len(bases)
    while len(covered) < partitions:
        host += 1
        base = f"http://10.2.0.{host}:8000/v1"
        if partition_of(base, partitions) not in covered:
            bases.append(base)
            covered.add(partition_of(base, partitions))
    return bases
