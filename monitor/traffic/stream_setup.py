"""What the traffic stream needs on the NATS server, and the connection to it.

At start (``kvcanary serve``, before anything listens: :func:`verify`; and again by every replica's
consumer once connected: :func:`prepare`) the monitor creates or updates the stream
(``traffic.jetstream.stream`` on ``<subject_prefix>.0`` to ``<subject_prefix>.<partitions - 1>``:
file storage, the retention figures, a duplicate window for the taps' ``Nats-Msg-Id``), one durable
pull consumer per partition (``kvcanary-p<n>``, explicit acknowledgement, ``ack_wait``, a bound on
what is out unacknowledged) that every replica shares, and the KV bucket in which replicas share
out the partitions (``partitions.py``).

The stream is a work queue: a record leaves it once judged (acknowledged), so ``max_bytes`` and
``max_age`` bound what waits unjudged (a monitor outage), not all that ever passed; with the
default limits retention a stream that refuses when full would refuse everything for good once its
size in traffic had passed through it. When full of unjudged records it refuses new ones
(``discard: new``) rather than dropping the oldest unread ones unseen: the taps then keep theirs,
bounded, and count what they drop. Its subjects are the partitions' own, not ``<prefix>.>``: a tap
with more partitions than the monitor (``KVCANARY_TAP_PARTITIONS``) finds no stream for the rest
and says so, where records on a subject no consumer reads would wait unjudged, unseen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue

from kvcanary.monitor.config.secrets import read_secret
from kvcanary.monitor.config.settings import ConfigError, JetStreamConfig
from kvcanary.monitor.traffic.partitions import LEASE_SECONDS

log = logging.getLogger("kvcanary.traffic")

CONNECT_TIMEOUT_SECONDS = 2
#: Where the monitor's replies and pulled messages come (not ``_INBOX``, which the taps may read:
#: ``docs/nats-permissions.conf`` lets only the monitors' user subscribe here).
INBOX_PREFIX = "_INBOX_kvcanary_monitor"

#: JetStream's "stream name already in use with a different configuration".
STREAM_EXISTS = 10058


def durable_name(partition: int) -> str:
    return f"kvcanary-p{partition}"


def stream_config(cfg: JetStreamConfig) -> StreamConfig:
    """The stream as configured (the module doc: a work queue, refusing when full, on the
    partitions' subjects only)."""
    return StreamConfig(
        name=cfg.stream, subjects=[f"{cfg.subject_prefix}.{n}" for n in range(cfg.partitions)],
        retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE,
        max_age=cfg.max_age_days * 86_400, max_bytes=cfg.max_bytes, discard=DiscardPolicy.NEW,
        duplicate_window=cfg.duplicate_window_seconds, num_replicas=cfg.stream_replicas,
    )  # fmt: skip


def consumer_config(cfg: JetStreamConfig, partition: int) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=durable_name(partition), filter_subject=f"{cfg.subject_prefix}.{partition}",
        ack_policy=AckPolicy.EXPLICIT, ack_wait=cfg.ack_wait_seconds, deliver_policy=DeliverPolicy.ALL,
        max_ack_pending=cfg.max_ack_pending,
    )  # fmt: skip


async def connect(cfg: JetStreamConfig, token: str | None, *, keep_trying: bool) -> Client:
    """Return a client connected to ``cfg.url``, as ``cfg.user`` with ``token`` its password where a
    user is configured, else with ``token``. ``keep_trying``: the running consumer, which
    reconnects for ever and logs once per outage; else raise at once, ConnectionError saying why
    (the check at start)."""
    said: list[BaseException] = []

    async def note(error: Exception) -> None:  # the client's own logging prints tracebacks
        if keep_trying and not said:
            log.warning("traffic stream: NATS at %s: %s; records wait in the stream", cfg.url, why(error))
        said[:] = [error]

    async def reconnected() -> None:
        said.clear()
        log.info("traffic stream: NATS at %s reached again", cfg.url)

    try:
        credentials = {"user": cfg.user, "password": token or ""} if cfg.user else {"token": token}
        return await nats.connect(
            cfg.url, **credentials, name="kvcanary-monitor", inbox_prefix=INBOX_PREFIX,
            connect_timeout=CONNECT_TIMEOUT_SECONDS,
            allow_reconnect=keep_trying, max_reconnect_attempts=-1 if keep_trying else 1,
            reconnect_time_wait=1.0, error_cb=note, reconnected_cb=reconnected,
        )  # fmt: skip
    except Exception as exc:
        raise ConnectionError(why(said[-1] if said else exc)) from None


async def prepare(js: JetStreamContext, cfg: JetStreamConfig) -> KeyValue:
    """Create or update the stream, the partitions' consumers and the ownership bucket."""
    try:
        await js.add_stream(stream_config(cfg))
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != STREAM_EXISTS:
            raise
        await js.update_stream(stream_config(cfg))
    await asyncio.gather(
        *(js.add_consumer(cfg.stream, consumer_config(cfg, n)) for n in range(cfg.partitions))
    )
    bucket = KeyValueConfig(
        bucket=cfg.bucket,
        ttl=LEASE_SECONDS,
        history=1,
        storage=StorageType.FILE,
        replicas=cfg.stream_replicas,
    )
    try:
        return await js.create_key_value(bucket)
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != STREAM_EXISTS:
            raise
        raise ConfigError(
            f"traffic.jetstream.bucket: {cfg.bucket} at {cfg.url} exists with another configuration "
            f"(leases need a {LEASE_SECONDS:.0f} s TTL); it holds only leases: delete it, or name another"
        ) from None


async def quarantine_bucket(js: JetStreamContext, cfg: JetStreamConfig) -> KeyValue:
    """Create the bucket the quarantine set is put in (one key, its last value kept: no TTL, since a
    set must outlive every monitor's absence), or bind the one there."""
    bucket = KeyValueConfig(
        bucket=cfg.quarantine_bucket, history=1, storage=StorageType.FILE, replicas=cfg.stream_replicas
    )
    try:
        return await js.create_key_value(bucket)
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != STREAM_EXISTS:
            raise
        return await js.key_value(cfg.quarantine_bucket)


async def verify(cfg: JetStreamConfig, token: str | None) -> None:
    """Reach NATS and prepare the stream once; raise ConfigError naming the key and the URL."""
    try:
        client = await connect(cfg, token, keep_trying=False)
    except ConnectionError as exc:
        raise ConfigError(f"traffic.jetstream.url: cannot reach NATS at {cfg.url} ({exc})") from None
    try:
        await prepare(client.jetstream(timeout=5), cfg)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
        raise ConfigError(
            f"traffic.jetstream.url: NATS at {cfg.url} does not answer for JetStream ({why(exc)}); "
            "start nats-server with -js"
        ) from None
    except nats.js.errors.APIError as exc:
        raise ConfigError(f"traffic.jetstream.stream: {cfg.stream} at {cfg.url}: {exc.description}") from None
    finally:
        with contextlib.suppress(Exception):
            await client.close()


def nats_token(cfg: JetStreamConfig) -> str | None:
    """Return NATS's auth token (or ``user``'s password) from ``token_file`` or ``token_env``; None:
    a server without auth."""
    return read_secret(env=cfg.token_env, file=cfg.token_file, key="traffic.jetstream.token_file")


def why(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
