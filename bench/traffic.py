"""Gateway traffic throughput, in one run, as rates of this machine:

- ``judge``: records judged per CPU-second by the monitor from a posted body's bytes (validation,
  the checks, the windows filling), in batches of 300 records of 1 KB exchanges;
- ``tap``: the tap's work per exchange (summary, fingerprints and distinctive tokens: what runs on
  its thread, after the response is sent) for 1 KB, 16 KB and 1 MB exchanges, p50 and p99.

``--against REV`` gives the ``judge`` figure side by side: the same bodies (made once, by this
tree's tap; without the fields an older tree does not know) judged by commit ``REV`` (exported
into a temporary folder, removed after) and by this working tree, each round a fresh process of
each, in turns whose order alternates, so that a machine shared with other work weighs on both
alike; it prints each round's figures, the medians and the ratio (the median of the rounds'
ratios). What the checks catch and their false alarms: ``bench/detection.py``.

    .venv/bin/python bench/traffic.py [--records 30000]
    .venv/bin/python bench/traffic.py --against HEAD [--rounds 5] [--records 30000]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import pickle
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The tree whose monitor is imported: this one, or (a turn of ``--against``) the exported commit's.
sys.path.insert(0, os.environ.get("KVCANARY_BENCH_TREE") or str(Path(__file__).resolve().parent.parent))

from prometheus_client import CollectorRegistry

from kvcanary import wire
from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.targets.calibration import TokenCalibration
from kvcanary.monitor.traffic.judge import TrafficJudge
from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.monitor.traffic.reading import read_batch
from kvcanary.probes.markers import MarkerBook
from kvcanary.probes.target import ServerCapacity
from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.record import Exchange, summarize

# The fingerprint key the figures use, beside this file (after the tree: a tree measured by
# ``--against`` has no bench folder).
sys.path.insert(1, str(Path(__file__).resolve().parent))
from overlap_corpus import KEY

HERE = Path(__file__).resolve().parent.parent
BATCH = 300

#: A body's envelope as this tree's monitor reads it: an older tree's (``--against``) has no
#: protocol version, and would refuse the field.
ENVELOPE = {"version": wire.VERSION} if hasattr(wire, "VERSION") else {}


def corpus(limit_chars: int = 6_000_000) -> list[str]:
    """Return Debian's shipped documentation and licences as paragraphs-sized documents."""
    texts: list[str] = []
    roots = [Path("/usr/share/common-licenses"), Path("/usr/share/doc")]
    total = 0
    for root in roots:
        for path in sorted(root.rglob("*")):
            if (
                not path.is_file()
                or path.stat().st_size < 2000
                or path.suffix not in ("", ".gz", ".txt", ".md")
            ):
                continue
            try:
                raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
                text = raw.decode("utf-8")
            except (OSError, UnicodeDecodeError, gzip.BadGzipFile, EOFError):
                continue
            texts.append(text)
            total += len(text)
            if total > limit_chars:
                return texts
    return texts


class Answers:
    calibration = TokenCalibration()

    async def capacity(self, max_age: float = 0.0) -> ServerCapacity:
        return ServerCapacity(kv_pool_tokens=1_000_000)


Answers.calibration.note(1000, 250)


def judge_bodies(docs: list[str], records: int) -> list[bytes]:
    """Return the bodies the judge figure times: batches of 300 records of 1 KB exchanges, as a
    tap posts them (2,000 exchanges of 8 callers, sent again in turn)."""
    fp = Fingerprinter(KEY)
    rng = random.Random(1)
    made = []
    for i in range(2000):
        doc = rng.choice(docs)
        at = rng.randrange(max(1, len(doc) - 1000))
        prompt, response = doc[at : at + 700], doc[at + 700 : at + 1000]
        ex = Exchange(
            f"r{i}",
            time.time(),
            f"c{i % 8}",
            "team",
            "http://127.0.0.1:9/v1",
            prompt=prompt,
            response=response,
        )
        made.append(summarize(ex, fp))
    return [
        json.dumps(
            {**ENVELOPE, "records": [made[(b * BATCH + j) % len(made)] for j in range(BATCH)]}
        ).encode()
        for b in range(records // BATCH)
    ]


def judge_rate(bodies: list[bytes]) -> float:
    """Return records judged per CPU-second: the monitor's whole work on each body, from its bytes
    (validation, each record on its own) to the judged records, by a fresh judge."""
    settings = Settings.model_validate(
        {
            "targets": [
                {"name": "t", "base_url": "http://127.0.0.1:9/v1", "tenants": [{"name": "a"}, {"name": "b"}]}
            ]
        }
    )
    judge = TrafficJudge(settings, {"t": Answers()}, MarkerBook(), MonitorMetrics(CollectorRegistry()))
    fields = getattr(TrafficRecord, "__struct_fields__", None) or getattr(TrafficRecord, "model_fields", {})
    if "distinctive" not in fields:  # a tree before the field refuses records that carry it
        bodies = [_without_distinctive(body) for body in bodies]

    async def run() -> float:
        start = time.process_time()  # every thread's, should any of the judge's work leave the loop
        for body in bodies:
            _, valid = read_batch(body)
            await judge.judge(valid.records, "bench")
        return time.process_time() - start

    took = asyncio.run(run())
    return len(bodies) * BATCH / took


def _without_distinctive(body: bytes) -> bytes:
    batch = json.loads(body)
    for record in batch["records"]:
        record.pop("distinctive", None)
    return json.dumps(batch).encode()


def bench_judge(docs: list[str], records: int) -> float:
    return judge_rate(judge_bodies(docs, records))


def judge_against(docs: list[str], records: int, rev: str, rounds: int) -> None:
    """Print the judge figure of ``rev`` and of this working tree, side by side (the module doc)."""
    bodies = judge_bodies(docs, records)
    with tempfile.TemporaryDirectory(prefix="kvcanary-bench-") as tmp:
        exported, given = export(rev, Path(tmp)), Path(tmp) / "bodies.pickle"
        given.write_bytes(pickle.dumps(bodies))
        trees = {rev: exported, "working tree": HERE}
        rates: dict[str, list[float]] = {name: [] for name in trees}
        for n in range(rounds):
            for name in list(trees) if n % 2 == 0 else list(trees)[::-1]:
                rates[name].append(_judge_in(trees[name], given))
            print(f"round {n + 1}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items()), flush=True)
    ratios = [new / old for old, new in zip(rates[rev], rates["working tree"], strict=True)]
    medians = ", ".join(f"{k} {statistics.median(v):,.0f}" for k, v in rates.items())
    print(f"judge: {medians} records per CPU-second (median of {rounds} rounds, batches of {BATCH})")
    print(f"judge: working tree / {rev}: {statistics.median(ratios):.2f}x "
          f"(rounds {min(ratios):.2f}x to {max(ratios):.2f}x)")  # fmt: skip


def export(rev: str, into: Path) -> Path:
    """Return a folder holding commit ``rev``'s tree: an export, not a worktree, so that a run cut
    short leaves nothing behind in the repository."""
    exported = into / "rev"
    exported.mkdir()
    archive = subprocess.run(["git", "-C", str(HERE), "archive", rev], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(exported)], input=archive.stdout, check=True)
    return exported


def _judge_in(tree: Path, bodies: Path) -> float:
    """Run the judge figure in a fresh process importing ``tree``'s monitor; return its rate."""
    done = subprocess.run(
        [sys.executable, __file__, "--judge-bodies", str(bodies)],
        env={**os.environ, "KVCANARY_BENCH_TREE": str(tree)}, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return float(done.stdout.split()[-1])


def bench_tap(docs: list[str]) -> dict[str, tuple[float, float]]:
    fp = Fingerprinter(KEY)
    text = "\n".join(docs)
    out = {}
    for label, size in (("1KB", 1024), ("16KB", 16 * 1024), ("1MB", 1024 * 1024)):
        took = []
        for i in range(200 if size < 100_000 else 30):
            at = (i * 7919) % max(1, len(text) - size)
            cut = at + size * 3 // 4
            ex = Exchange(
                "r", 0.0, "c", "team", "http://x", prompt=text[at:cut], response=text[cut : at + size]
            )
            start = time.perf_counter()
            summarize(ex, fp)
            took.append(time.perf_counter() - start)
        took.sort()
        out[label] = (took[len(took) // 2] * 1e3, took[int(len(took) * 0.99) - 1] * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=30_000)
    parser.add_argument("--against", metavar="REV", help="the judge figure beside commit REV's")
    parser.add_argument("--rounds", type=int, default=5, help="turns of each tree, with --against")
    parser.add_argument("--judge-bodies", type=Path, help=argparse.SUPPRESS)  # one turn of --against
    args = parser.parse_args()
    if args.judge_bodies is not None:
        print(judge_rate(pickle.loads(args.judge_bodies.read_bytes())))
        return
    docs = corpus()
    print(f"corpus: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.1f} MB from /usr/share")
    if args.against is not None:
        judge_against(docs, args.records, args.against, args.rounds)
        return
    print(f"judge: {bench_judge(docs, args.records):,.0f} records per CPU-second (batches of {BATCH})")
    for label, (p50, p99) in bench_tap(docs).items():
        print(f"tap: {label} exchange: p50 {p50:.2f} ms, p99 {p99:.2f} ms of work on the tap's thread")


if __name__ == "__main__":
    main()
