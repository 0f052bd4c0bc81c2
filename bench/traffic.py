"""Gateway traffic figures (issue 18), in one run, as ratios and rates of this machine:

- ``judge``: records judged per CPU-second by the monitor from a posted body's bytes (validation,
  the four checks, the overlap window filling), in batches of 300 records of 1 KB exchanges;
- ``tap``: the tap's work per exchange (summary and fingerprints: what runs on its thread, after
  the response is sent) for 1 KB, 16 KB and 1 MB exchanges, p50 and p99;
- ``overlap``: the overlap rule's false alarms on real text nobody here wrote (the documentation
  and licence texts Debian ships, ``/usr/share/doc`` and ``/usr/share/common-licenses``), sent by
  several callers who share a system prompt and licences, with answers quoting their own
  prompts; and its recall on injected leaks (an answer carrying a stretch of another caller's
  prompt, 40 to 200 words).

``--against REV`` gives the ``judge`` figure only, side by side: the same bodies (made once, by
this tree's tap) judged by commit ``REV`` (exported into a temporary folder, removed after) and by
this working tree, each round a fresh process of each, in turns whose order alternates, so that a
machine shared with other work weighs on both alike; it prints each round's figures, the medians
and the ratio (the median of the rounds' ratios).

    .venv/bin/python bench/traffic.py [--records 30000] [--callers 8]
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
from typing import Any

# The tree whose monitor is imported: this one, or (a turn of ``--against``) the exported commit's.
sys.path.insert(0, os.environ.get("KVCANARY_BENCH_TREE") or str(Path(__file__).resolve().parent.parent))

from prometheus_client import CollectorRegistry

from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.record import Exchange, summarize
from monitor.config.settings import Settings
from monitor.metrics.registry import MonitorMetrics
from monitor.targets.calibration import TokenCalibration
from monitor.traffic.checks import OVERLAP_MIN_RUN
from monitor.traffic.judge import TrafficJudge
from monitor.traffic.overlap import OverlapWindow
from monitor.traffic.schema import read_batch
from probes.markers import MarkerBook
from probes.target import ServerCapacity

HERE = Path(__file__).resolve().parent.parent
KEY = b"bench-fingerprint-key-0123456789"
BATCH = 300


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
        json.dumps({"records": [made[(b * BATCH + j) % len(made)] for j in range(BATCH)]}).encode()
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

    async def run() -> float:
        start = time.process_time()  # every thread's, should any of the judge's work leave the loop
        for body in bodies:
            _, valid = read_batch(body)
            await judge.judge(valid.records, "bench")
        return time.process_time() - start

    took = asyncio.run(run())
    return len(bodies) * BATCH / took


def bench_judge(docs: list[str], records: int) -> float:
    return judge_rate(judge_bodies(docs, records))


def judge_against(docs: list[str], records: int, rev: str, rounds: int) -> None:
    """Print the judge figure of ``rev`` and of this working tree, side by side (the module doc)."""
    bodies = judge_bodies(docs, records)
    with tempfile.TemporaryDirectory(prefix="kvcanary-bench-") as tmp:
        exported, given = Path(tmp) / "rev", Path(tmp) / "bodies.pickle"
        exported.mkdir()
        # An export, not a worktree: a run cut short leaves nothing behind in the repository.
        archive = subprocess.run(["git", "-C", str(HERE), "archive", rev], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(exported)], input=archive.stdout, check=True)
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


def bench_overlap(docs: list[str], callers: int, exchanges: int) -> dict[str, Any]:
    """False alarms on benign traffic sharing boilerplate; recall on injected leaks.

    Each caller's own text comes from documents no other caller reads (``docs[k::callers]``), as
    customers' own data does; every caller may send the same system prompt and Debian's licences
    (boilerplate); a benign answer quotes the caller's own prompt, a licence or the system prompt.
    A leak is an answer carrying a stretch of another caller's own text, as the tap would send it.
    """
    tap = Fingerprinter(KEY)
    rng = random.Random(3)
    licences = sorted(Path("/usr/share/common-licenses").glob("*"))
    shared = [p.read_text(errors="replace")[:3000] for p in licences if p.is_file()][:6]
    system = (
        "You are the assistant of a software company. Answer in English, briefly, and cite the text you use."
    )
    window = OverlapWindow(900, 2_000_000, 3)
    alarms, seen = 0, []

    def record(caller: str, prompt: str, response: str, at: float) -> tuple[list[int], list[int]]:
        ex = Exchange("r", at, caller, "team", "http://x", prompt=prompt, response=response)
        prints = summarize(ex, tap)["fingerprints"]
        return prints["prompt"], prints["response"]

    for i in range(exchanges):
        k = i % callers
        own_docs = docs[k::callers]
        doc = rng.choice(own_docs)
        at = rng.randrange(max(1, len(doc) - 2500))
        own = doc[at : at + 2000]
        licence = rng.choice(shared) if rng.random() < 0.5 else ""
        quote = rng.choice([own[200:900], (licence or system)[300:1000], system])
        prompt_fp, response_fp = record(
            f"c{k}", "\n".join([system, licence, own]), "Here it is: " + quote, float(i)
        )
        alarms += window.longest_run(f"c{k}", prompt_fp, response_fp, float(i)).run >= OVERLAP_MIN_RUN
        window.add(f"c{k}", prompt_fp + response_fp, float(i))
        seen.append((k, own))
    caught = {40: [0, 0], 80: [0, 0], 200: [0, 0]}
    for _ in range(300):
        victim, text = seen[-1 - rng.randrange(200)]
        reader = (victim + 1) % callers
        words = text.split()
        for n, tally in caught.items():
            start = rng.randrange(max(1, len(words) - n))
            asked = "Summarize our meeting notes, please."
            _, leaked = record(
                f"c{reader}", asked, "Sure. " + " ".join(words[start : start + n]), float(exchanges)
            )
            tally[0] += window.longest_run(f"c{reader}", [], leaked, float(exchanges)).run >= OVERLAP_MIN_RUN
            tally[1] += 1
    return {
        "benign": exchanges,
        "false_alarms": alarms,
        "recall": {n: t[0] / t[1] for n, t in caught.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=30_000)
    parser.add_argument("--callers", type=int, default=8)
    parser.add_argument("--exchanges", type=int, default=5000)
    parser.add_argument("--against", metavar="REV", help="the judge figure only, beside commit REV's")
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
    o = bench_overlap(docs, args.callers, args.exchanges)
    recall = ", ".join(f"{n} words {r:.0%}" for n, r in o["recall"].items())
    alarms = f"{o['false_alarms']} false alarms in {o['benign']} benign exchanges of {args.callers} callers"
    print(f"overlap: {alarms}; recall on injected leaks: {recall}")


if __name__ == "__main__":
    main()
