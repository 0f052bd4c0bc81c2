"""Gateway traffic through NATS JetStream, in one run, on real processes of this machine:

- ``throughput``: records judged per second, and per CPU-second of the consuming monitor: one
  ``kvcanary serve`` (``traffic.source: jetstream``, PostgreSQL) holds all 16 partitions; the bench
  publishes ``--records`` records of 1 KB exchanges (summarized by the tap beforehand, so the
  publisher's work is not the monitor's) to the stream as fast as JetStream acknowledges them, and
  times until every record id is in ``traffic_judged``. The monitor's CPU is its process's
  user + system time from ``/proc/PID/stat`` (every thread; PostgreSQL's and NATS's own are not
  in it), read before the first publish and once the last id is stored; its idle rate (probe
  scheduler, partition leases, 16 pulls waiting) is printed beside;
- ``delay``: from the moment the real tap (:class:`kvcanary.tap.Tap`, its Sender's defaults: a
  batch at 200 records or 1 s) is handed an exchange (``Tap.observe``) to the moment its verdict is
  stored (``traffic_judged.judged_at``, stamped in the transaction that stores the record's rows
  and counts), p50, p99 and max, at a steady ``--rate`` for ``--seconds``, through the same monitor;
  and its two parts: in the tap until JetStream acknowledged the publish (the tap's transport,
  wrapped, notes when its ``send`` returned), and from that acknowledgement to ``judged_at``;
- ``replica loss``: two ``kvcanary serve`` replicas on a database of their own share the
  partitions; traffic flows at ``--rate``; one replica is SIGKILLed at a moment it holds records
  pulled and not acknowledged (JetStream's consumer info says so). Right after the kill the bench
  reads which records those were (per partition of the dead one: the messages still in the work
  queue between the consumer's ack floor and its last delivered sequence), then measures (a) how
  long until the survivor holds every partition (its ``/healthz``), (b) how long until the dead
  one's unacknowledged records were judged (the last ``judged_at`` of them less the kill, and the
  most ``judged_at`` less publish of them), and (c) whether every record sent was judged exactly once:
  the judged ids are exactly the ids sent, and the per-minute counts (``traffic_minute.records``,
  which every judging adds to) sum to the records sent. ``--ack-wait`` (the config's default: 30 s)
  is how long the dead one's records wait before JetStream delivers them again.

Everything runs on 127.0.0.1: a ``nats-server -js`` of the bench's own on a free port, its store in
a temporary folder (or ``--nats URL``, a running one), and PostgreSQL (``--pg-host``/``--pg-port``,
user postgres, trust), where each part creates a database and drops it after. Streams, buckets and
subjects are named for the run (``KVC_BENCH_<tag>``, 64 MiB each: NATS reserves a stream's size on
its disk) and deleted after; every process started is stopped, on an error or Ctrl-C too.

    .venv/bin/python bench/jetstream.py [--records 20000] [--rate 200] [--seconds 30]
                                        [--ack-wait 30] [--skip-replicas] [--nats URL]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import nats  # noqa: E402  (run as a script from the repository)
import nats.js.errors  # noqa: E402

from bench.jetstream_rig import (  # noqa: E402
    KEY,
    PARTITIONS,
    Database,
    Monitor,
    Traffic,
    close_tap,
    connected,
    cpu_seconds,
    exchange,
    monitor_config,
    named_by_exchange,
    new_names,
    new_tap,
    percentile,
    publish_all,
    until,
)
from kvcanary.monitor.traffic.partitions import LEASE_SECONDS, STEP_SECONDS  # noqa: E402
from kvcanary.monitor.traffic.stream_setup import durable_name  # noqa: E402
from kvcanary.tap.fingerprints import Fingerprinter  # noqa: E402
from kvcanary.tap.jetstream import JetStreamTransport  # noqa: E402
from kvcanary.tap.record import summarize  # noqa: E402
from tests.support.jetstream import OwnNats, StreamNames, delete_created  # noqa: E402


def bench_throughput(monitor: Monitor, db: Database, nats_url: str, names: StreamNames, records: int) -> None:
    prefix = f"tp-{uuid.uuid4().hex[:6]}-"
    fp = Fingerprinter(KEY)
    made = named_by_exchange([summarize(exchange(f"{prefix}{i}", i), fp) for i in range(records)])
    transport = JetStreamTransport(nats_url, None, partitions=PARTITIONS, subject_prefix=names.subject_prefix)
    try:
        idle_from, idle_cpu = time.monotonic(), cpu_seconds(monitor.pid)
        time.sleep(3)
        idle = (cpu_seconds(monitor.pid) - idle_cpu) / (time.monotonic() - idle_from)
        cpu0, wall0 = cpu_seconds(monitor.pid), time.time()
        publish_all(transport, made, timeout=120 + records / 500)
        published = time.time() - wall0
        until("every record judged", lambda: db.judged(prefix) >= records, 120 + records / 200, 0.05)
        cpu = cpu_seconds(monitor.pid) - cpu0
    finally:
        transport.close()
    wall = max(db.judged_at(prefix).values()) - wall0
    counted, flagged = db.minute_counts()
    print(f"throughput: {records:,} records of 1 KB exchanges published in {published:.1f} s "
          f"({records / published:,.0f}/s acknowledged by JetStream), all judged {wall:.1f} s "
          "after the first")  # fmt: skip
    print(f"throughput: {records / wall:,.0f} records judged per second; monitor CPU {cpu:.2f} s "
          f"({cpu / wall:.2f} cores busy): {records / cpu:,.0f} records per CPU-second "
          f"(idle, the monitor uses {idle:.3f} cores)")  # fmt: skip
    print(
        f"throughput: counted per minute {counted:,}, of them flagged {flagged} (benign traffic: 0 expected)"
    )


def bench_delay(
    monitor: Monitor, db: Database, nats_url: str, names: StreamNames, rate: float, seconds: float
) -> None:
    prefix = f"dl-{uuid.uuid4().hex[:6]}-"
    n = int(rate * seconds)
    tap = new_tap(nats_url, names)
    traffic = Traffic(tap, prefix, rate, n)
    counted_before, _ = db.minute_counts()
    try:
        cpu0, wall0 = cpu_seconds(monitor.pid), time.monotonic()
        traffic.start()
        traffic.join(seconds + 60)
        until("every record judged", lambda: db.judged(prefix) >= n, 60 + seconds, 0.1)
        cpu, wall = cpu_seconds(monitor.pid) - cpu0, time.monotonic() - wall0
    finally:
        traffic.stop()
        close_tap(tap, 5)
    judged = db.judged_at(prefix)
    delays = [(judged[r] - t) * 1000 for r, t in traffic.observed.items()]
    in_tap = [(traffic.published[r] - t) * 1000 for r, t in traffic.observed.items()]
    in_stream = [(judged[r] - t) * 1000 for r, t in traffic.published.items()]
    counted, _ = db.minute_counts()
    stats = tap.stats()
    print(f"delay: {n:,} records at {rate:.0f}/s for {seconds:.0f} s through the real tap (batches of "
          f"{tap.sender.batch_records} or {tap.sender.flush_seconds:g} s), from Tap.observe to "
          "judged_at:")  # fmt: skip
    print(f"delay: p50 {percentile(delays, 0.5):.0f} ms, p99 {percentile(delays, 0.99):.0f} ms, "
          f"max {max(delays):.0f} ms; tap sent {stats['sent']}, dropped {stats['dropped']}; judged "
          f"{len(judged)}, counted per minute {counted - counted_before}")  # fmt: skip
    print(f"delay: of it, in the tap until JetStream acknowledged: p50 {percentile(in_tap, 0.5):.0f} ms, "
          f"p99 {percentile(in_tap, 0.99):.0f} ms; from that acknowledgement to judged_at: p50 "
          f"{percentile(in_stream, 0.5):.0f} ms, p99 {percentile(in_stream, 0.99):.0f} ms")  # fmt: skip
    print(f"delay: monitor CPU {cpu:.2f} s over {wall:.1f} s at this rate: "
          f"{n / cpu:,.0f} records per CPU-second")  # fmt: skip


async def _kill_holding_unacked(
    victim: Monitor, nats_url: str, names: StreamNames, owned: list[int]
) -> tuple[float, set[str], int]:
    """SIGKILL ``victim`` once its consumers hold messages pulled and not acknowledged (else after
    10 s anyway); return the time of the kill, the ids of the records in those, and the messages of
    its partitions not yet delivered then."""
    client = await connected(nats_url)
    js = client.jetstream(timeout=5)
    try:
        deadline = time.monotonic() + 10
        while True:
            infos = await asyncio.gather(*(js.consumer_info(names.stream, durable_name(p)) for p in owned))
            if sum(i.num_ack_pending for i in infos) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        victim.kill()
        killed = time.time()
        # Nobody consumes its partitions until the survivor claims them (a lease): what is out is its.
        infos = await asyncio.gather(*(js.consumer_info(names.stream, durable_name(p)) for p in owned))
        unacked: set[str] = set()
        for p, info in zip(owned, infos, strict=True):
            subject = f"{names.subject_prefix}.{p}"
            low, high = info.ack_floor.stream_seq, info.delivered.stream_seq
            for seq in range(low + 1, min(high, low + 5000) + 1):
                try:
                    msg = await js.get_msg(names.stream, seq)
                except nats.js.errors.NotFoundError:  # acknowledged: gone from the work queue
                    continue
                if msg.subject == subject and msg.data:
                    unacked |= _record_ids(msg.data)
        waiting = sum(i.num_pending for i in infos)
        return killed, unacked, waiting
    finally:
        await client.close()


def _record_ids(payload: bytes) -> set[str]:
    """The ids of the records a message carries: a tap batch's share (``{"records": [...]}``)."""
    return {str(r["id"]) for r in json.loads(payload)["records"] if r.get("id")}


def bench_replicas(
    db: Database, nats_url: str, names: StreamNames, folder: Path, rate: float, ack_wait: float,
    started: Callable[[Monitor], None],
) -> None:  # fmt: skip
    """The replica-loss figures (the module doc); ``started`` is handed each replica, to stop it."""
    config = monitor_config(db.url, names, nats_url, ack_wait)
    first = Monitor(folder / "replica-1", config)
    started(first)
    first.start(migrate=True)
    second = Monitor(folder / "replica-2", config)
    started(second)
    second.start(migrate=False)
    replicas = [first, second]

    def shared() -> bool:
        held = [len(m.partitions()) for m in replicas]
        return sum(held) == PARTITIONS and all(held)

    until("the two replicas to share the partitions", shared, 6 * LEASE_SECONDS + 30, 0.25)
    prefix = f"rl-{uuid.uuid4().hex[:6]}-"
    tap = new_tap(nats_url, names)
    traffic = Traffic(tap, prefix, rate, int(rate * (ack_wait + 120)))
    try:
        traffic.start()
        time.sleep(5)  # traffic flowing through both
        until("both replicas to judge", lambda: all(m.report().get("judged") for m in replicas), 30)
        victim, survivor = first, second
        owned = victim.partitions()
        killed, unacked, waiting = asyncio.run(
            asyncio.wait_for(_kill_holding_unacked(victim, nats_url, names, owned), 60)
        )
        until("the survivor to hold every partition", lambda: len(survivor.partitions()) == PARTITIONS,
              6 * LEASE_SECONDS + 30, 0.05)  # fmt: skip
        took_over = time.time() - killed
        time.sleep(5)  # traffic flowing to the survivor alone
        traffic.stop()
        close_tap(tap, 10)
        sent = len(traffic.observed)
        until(
            "every record judged", lambda: db.judged(prefix) >= sent, ack_wait + 4 * LEASE_SECONDS + 60, 0.1
        )
        time.sleep(3 + 2 * STEP_SECONDS)  # a record judged twice would land meanwhile
    finally:
        traffic.stop()
        close_tap(tap, 5)
    judged = db.judged_at(prefix)
    counted, _ = db.minute_counts()
    stats, report = tap.stats(), survivor.report()
    print(f"replica loss: {rate:.0f} records/s to 2 replicas ({len(owned)} and {PARTITIONS - len(owned)} "
          f"partitions); the one with {len(owned)} SIGKILLed holding {len(unacked)} records pulled and "
          f"not acknowledged ({waiting} messages more not yet delivered); ack_wait {ack_wait:g} s, "
          f"lease {LEASE_SECONDS:g} s")  # fmt: skip
    print(f"replica loss: (a) the survivor held all {PARTITIONS} partitions {took_over:.1f} s after the kill")
    if unacked:
        late = [judged[r] for r in unacked if r in judged]
        before = sum(t < killed for t in late)
        since_kill = max(late) - killed
        since_publish = max(judged[r] - traffic.published[r] for r in unacked if r in judged)
        since_observe = max(judged[r] - traffic.observed[r] for r in unacked if r in judged)
        print(f"replica loss: (b) the dead one's {len(unacked)} unacknowledged records all judged "
              f"{since_kill:.1f} s after the kill: judged_at - publish at most {since_publish:.1f} s "
              f"(- Tap.observe at most {since_observe:.1f} s); {before} of them it had stored before "
              "dying (found judged on redelivery)")  # fmt: skip
    else:
        print("replica loss: (b) the dead one held no unacknowledged records at the kill")
    delays = [judged[r] - t for r, t in traffic.observed.items() if r in judged]
    print(f"replica loss: delay of all records in this part: p50 {percentile(delays, 0.5) * 1000:.0f} ms, "
          f"p99 {percentile(delays, 0.99):.1f} s, max {max(delays):.1f} s")  # fmt: skip
    # Each id is in traffic_judged once (its key); judging it twice would count it twice per minute.
    exact = set(judged) == set(traffic.observed) and counted == sent
    print(f"replica loss: (c) sent {sent:,} (tap acknowledged {stats['sent']:,}, dropped "
          f"{stats['dropped']}); judged ids {len(judged):,} (the ids sent: "
          f"{set(judged) == set(traffic.observed)}), counted per minute {counted:,}; the survivor "
          f"judged {report.get('judged')} and acknowledged {report.get('duplicates')} redelivered "
          f"without judging again: {'exactly once' if exact else 'NOT EXACTLY ONCE'}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=20_000, help="records of the throughput figure")
    parser.add_argument("--rate", type=float, default=200.0, help="records per second, delay and replicas")
    parser.add_argument(
        "--seconds", type=float, default=30.0, help="how long the delay figure's traffic runs"
    )
    parser.add_argument("--ack-wait", type=float, default=30.0, help="traffic.jetstream.ack_wait_seconds")
    parser.add_argument("--skip-replicas", action="store_true", help="throughput and delay only")
    parser.add_argument(
        "--nats", metavar="URL", help="a running NATS with JetStream (default: one of its own)"
    )
    parser.add_argument("--pg-host", default="127.0.0.1")
    parser.add_argument("--pg-port", type=int, default=5432)
    args = parser.parse_args()
    if not 1 <= args.records <= 50_000 or not 1 <= args.rate <= 2000 or not 1 <= args.seconds <= 300:
        parser.error("bounded: --records 1 to 50000, --rate 1 to 2000, --seconds 1 to 300")
    if not 1 <= args.ack_wait <= 120:
        parser.error("--ack-wait: 1 to 120 seconds")
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; monitor CPU from "
          f"/proc/PID/stat of the kvcanary serve process; PostgreSQL at "
          f"{args.pg_host}:{args.pg_port}")  # fmt: skip
    with contextlib.ExitStack() as cleanup:
        folder = Path(tempfile.mkdtemp(prefix="kvcanary-bench-js-"))
        cleanup.callback(shutil.rmtree, folder, ignore_errors=True)
        if args.nats:
            nats_url = args.nats
        else:
            server = OwnNats(folder / "nats-store").start()
            cleanup.callback(server.stop)
            nats_url = server.url
        print(f"nats: {nats_url}")

        def named() -> StreamNames:
            names = new_names()
            cleanup.callback(delete_created, names, nats_url)
            return names

        def database() -> Database:
            db = Database(args.pg_host, args.pg_port)
            cleanup.callback(db.drop)
            return db

        db, names = database(), named()
        monitor = Monitor(folder / "monitor", monitor_config(db.url, names, nats_url, args.ack_wait))
        cleanup.callback(monitor.stop)
        monitor.start(migrate=True)
        until("the monitor to hold every partition", lambda: len(monitor.partitions()) == PARTITIONS, 60)
        bench_throughput(monitor, db, nats_url, names, args.records)
        bench_delay(monitor, db, nats_url, names, args.rate, args.seconds)
        monitor.stop()
        if not args.skip_replicas:
            db, names = database(), named()
            bench_replicas(
                db, nats_url, names, folder, args.rate, args.ack_wait, lambda m: cleanup.callback(m.stop)
            )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("interrupted: every process it started is stopped, its streams and databases deleted")
