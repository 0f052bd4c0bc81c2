"""Gateway traffic figures (issue 18), in one run, as ratios and rates of this machine:

- ``judge``: records judged per CPU-second by the monitor from a posted body's bytes (validation,
  the four checks, the overlap window filling), in batches of 300 records of 1 KB exchanges;
- ``tap``: the tap's work per exchange (summary and fingerprints: what runs on its thread, after
  the response is sent) for 1 KB, 16 KB and 1 MB exchanges, p50 and p99;
- ``overlap``: for each overlap rule asked (``--rules``: ``8`` is a run of 8 prints of anything,
  ``-/5`` a run of 5 prints one other caller alone asked (the settings' default), ``8/4`` either),
  its false alarms by kind on benign traffic of real text nobody here wrote
  (``bench/overlap_corpus.py``), its recall on private passages of 40, 80 and 200 words leaked into
  another caller's answer, and its CPU time. ``KVCANARY_BENCH_TREE=<a checkout> ... --overlap-only``
  measures that checkout's window and check on the same traffic (the rules its window knows).

``--against REV --overlap-only`` prints the detection figures (the default rules) of commit ``REV``
and of this working tree, one after the other, on the same traffic. ``--against REV`` alone gives
the ``judge`` figure only, side by side: the same bodies (made once, by
this tree's tap) judged by commit ``REV`` (exported into a temporary folder, removed after) and by
this working tree, each round a fresh process of each, in turns whose order alternates, so that a
machine shared with other work weighs on both alike; it prints each round's figures, the medians
and the ratio (the median of the rounds' ratios).

    .venv/bin/python bench/traffic.py [--records 30000] [--callers 8]
    .venv/bin/python bench/traffic.py --overlap-only [--rules 8 -/4 8/4] [--exchanges 5000]
    .venv/bin/python bench/traffic.py --against HEAD [--rounds 5] [--records 30000]
    .venv/bin/python bench/traffic.py --against HEAD --overlap-only
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gzip
import inspect
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
from typing import Any, NamedTuple

# The tree whose monitor is imported: this one, or (a turn of ``--against``) the exported commit's.
sys.path.insert(0, os.environ.get("KVCANARY_BENCH_TREE") or str(Path(__file__).resolve().parent.parent))

from prometheus_client import CollectorRegistry

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.targets.calibration import TokenCalibration
from kvcanary.monitor.traffic.judge import TrafficJudge

try:  # the checks as a package (one file a check), or as the one module they were before
    from kvcanary.monitor.traffic.checks.overlap_run import (
        OVERLAP_MIN_RUN,
        longest_unexcused_run,
        overlap_check,
    )
except ImportError:
    from kvcanary.monitor.traffic.checks import (  # type: ignore[no-redef]
        OVERLAP_MIN_RUN,
        longest_unexcused_run,
        overlap_check,
    )
from kvcanary.monitor.traffic.overlap import OverlapWindow
from kvcanary.monitor.traffic.schema import TrafficRecord, read_batch
from kvcanary.probes.markers import MarkerBook
from kvcanary.probes.target import ServerCapacity
from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.record import Exchange, summarize

# The benign corpus beside this file (after the tree: a tree measured by ``--against`` has none).
sys.path.insert(1, str(Path(__file__).resolve().parent))
from overlap_corpus import (
    KEY,
    LEAK_TOKENS,
    LEAK_WORDS,
    Sent,
    benign_traffic,
    private_leaks,
    records_of,
    reworded_leaks,
)

HERE = Path(__file__).resolve().parent.parent
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


def detection_against(rev: str, forwarded: list[str]) -> None:
    """Print the detection figures (``--overlap-only``, the default rules) of ``rev`` and of this
    working tree, one after the other, on the same traffic: each tree's checks in a process of
    its own, the corpus this file's."""
    with tempfile.TemporaryDirectory(prefix="kvcanary-bench-") as tmp:
        trees = {rev: export(rev, Path(tmp)), "working tree": HERE}
        for name, tree in trees.items():
            env = {**os.environ, "KVCANARY_BENCH_TREE": str(tree)}
            done = subprocess.run(
                [sys.executable, __file__, "--overlap-only", *forwarded],
                env=env, check=True, capture_output=True, text=True,
            )  # fmt: skip
            for line in done.stdout.splitlines():
                if not line.startswith("corpus:"):
                    print(f"{name}: {line}", flush=True)


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


class Rule(NamedTuple):
    """An overlap rule: a run of ``min_run`` prints of anything another caller sent (None: not
    counted), or (where the window knows what callers asked) of ``prompt_run`` prints another
    caller sent in a prompt (None: not counted). The settings' default is ``Rule(None, 5)``."""

    min_run: int | None
    prompt_run: int | None = None

    def __str__(self) -> str:
        runs = [f"run {self.min_run}"] if self.min_run else []
        return ", ".join(runs + ([f"prompts {self.prompt_run}"] if self.prompt_run else []))


#: A run no answer reaches: a rule turned off, for a check that takes a number.
NEVER = 1 << 30


def prompt_run_leaked(
    caller: str, prompt: list[int], response: list[int], window: OverlapWindow, now: float, rule: Rule
) -> bool:
    """Whether ``rule`` flags the answer, as the overlap check applies it (without adding the
    exchange to the window): the run of anything first, then the shorter run of what others asked."""
    anything = rule.min_run or NEVER
    found = longest_unexcused_run(
        caller, prompt, response, window, now, min(anything, rule.prompt_run or NEVER)
    )
    if found is None or found.run >= anything:
        return found is not None
    if rule.prompt_run is None or found.run < rule.prompt_run:  # a run of asked prints is no longer
        return False
    asked = window.asked
    found = longest_unexcused_run(caller, prompt, response, asked, now, rule.prompt_run)
    return found is not None and found.run >= rule.prompt_run


def judge_benign(records: list[TrafficRecord], rule: Rule) -> tuple[OverlapWindow, list[bool], float]:
    """Judge the benign records in order as the overlap check does; return the window, each
    record's verdict (a leak or not) and the CPU-seconds the rule took."""
    window = OverlapWindow(900, 2_000_000, 3)
    leaks: list[bool] = []
    start = time.process_time()
    # The check as the tree has it: with the prompt rule (this tree), or a run of anything only.
    both = "min_prompt_run" in inspect.signature(overlap_check).parameters
    runs = (rule.min_run, rule.prompt_run or NEVER) if both else (rule.min_run,)
    for i, record in enumerate(records):
        found = overlap_check(record, window, float(i), *runs)
        leaks.append(found is not None and found.verdict == "leak")
    return window, leaks, time.process_time() - start


def bench_overlap(
    sent: list[Sent], private: list[tuple[int, str]], records: list[TrafficRecord], callers: int,
    rules: list[Rule],
) -> dict[Rule, dict[str, Any]]:  # fmt: skip
    """For each rule: false alarms on the benign traffic (by kind) as the overlap check judges it,
    recall on private passages of 40, 80 and 200 words leaked to another caller (judged against
    the window the benign traffic left), and the rule's CPU time per benign record."""
    exchanges = len(sent)
    leaks = private_leaks(sent, private, callers)
    tap, asked = Fingerprinter(KEY), "Summarize our meeting notes, please."
    asked_fp = [tap.whole(asked)]
    leaked = [(v, n, tap.fingerprints("Sure. " + passage)[0]) for v, n, passage in leaks]
    kinds = collections.Counter(s.kind for s in sent)
    out: dict[Rule, dict[str, Any]] = {}
    for rule in rules:
        window, verdicts, took = judge_benign(records, rule)
        alarms = collections.Counter(s.kind for s, leak in zip(sent, verdicts, strict=True) if leak)
        hits = [
            prompt_run_leaked(f"c{(victim + 1) % callers}", asked_fp, fp, window, float(exchanges), rule)
            for victim, _, fp in leaked
        ]
        out[rule] = {
            "alarms": alarms,
            "kinds": kinds,
            "hits": hits,  # each leak of ``private_leaks``, in order: caught or not
            "recall": recall_by(leaks, hits),
            "us_per_record": took / len(records) * 1e6,
        }
    return out


def recall_by(leaks: list[tuple[int, int, str]], hits: list[bool]) -> dict[int, float]:
    """Return the share of leaks caught, by the passage's length in words."""
    caught: dict[int, list[int]] = {n: [0, 0] for n in LEAK_WORDS}
    for (_, n, _), hit in zip(leaks, hits, strict=True):
        caught[n][0] += hit
        caught[n][1] += 1
    return {n: hit / total for n, (hit, total) in caught.items()}


def bench_reworded(
    sent: list[Sent], private: list[tuple[int, str]], records: list[TrafficRecord], callers: int,
    min_tokens: int,
) -> dict[str, Any] | None:  # fmt: skip
    """The reworded check's false alarms on the benign traffic (by kind), its recall on reworded
    leaks of k = 3, 5, 8 tokens and on the overlap figure's private passages (judged against the
    window the benign traffic left), and its CPU time a record; None in a tree without it."""
    try:
        from kvcanary.monitor.traffic.checks.reworded import reworded_check
        from kvcanary.monitor.traffic.distinctive import DistinctiveWindow
        from kvcanary.tap.distinctive import TokenPrints
    except ImportError:
        return None
    window = DistinctiveWindow(900, 2_000_000)
    start = time.process_time()
    verdicts = [reworded_check(r, window, float(i), min_tokens) for i, r in enumerate(records)]
    took = time.process_time() - start
    flagged = [v is not None and v.verdict == "leak" for v in verdicts]
    alarms = collections.Counter(s.kind for s, leak in zip(sent, flagged, strict=True) if leak)
    tap, now = TokenPrints(KEY), float(len(records))
    caught: dict[int, list[int]] = {k: [0, 0] for k in LEAK_TOKENS}
    for victim, k, asked, answer in reworded_leaks(sent, private, callers):
        prompt, said = tap.exchange(asked, answer)
        found = window.most_shared(f"c{(victim + 1) % callers}", prompt, said, now, min_tokens)
        caught[k][0] += found.tokens >= min_tokens
        caught[k][1] += 1
    asked, passages = tap.of("Summarize our meeting notes, please."), private_leaks(sent, private, callers)
    hits = [
        window.most_shared(f"c{(victim + 1) % callers}", asked, tap.exchange("", "Sure. " + passage)[1],
                           now, min_tokens).tokens >= min_tokens
        for victim, _, passage in passages
    ]  # fmt: skip
    return {
        "alarms": alarms,
        "kinds": collections.Counter(s.kind for s in sent),
        "recall": {k: hit / total for k, (hit, total) in caught.items()},
        "hits": hits,
        "passages": passages,
        "us_per_record": took / len(records) * 1e6,
    }


def parse_rule(text: str) -> Rule:
    """``8`` (a run of 8 prints of anything), ``8/4`` (that, or 4 of another caller's prompt) or
    ``-/5`` (5 of another caller's prompt only: the settings' default)."""
    first, _, second = text.partition("/")
    return Rule(None if first == "-" else int(first), int(second) if second else None)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=30_000)
    parser.add_argument("--callers", type=int, default=8)
    parser.add_argument("--exchanges", type=int, default=5000)
    parser.add_argument("--against", metavar="REV", help="the judge figure only, beside commit REV's")
    parser.add_argument("--rounds", type=int, default=5, help="turns of each tree, with --against")
    parser.add_argument("--overlap-only", action="store_true", help="the overlap figures only")
    parser.add_argument(
        "--rules",
        type=parse_rule,
        nargs="+",
        default=[Rule(OVERLAP_MIN_RUN), Rule(4), Rule(None, 4), Rule(None, 5), Rule(OVERLAP_MIN_RUN, 4)],
        help="overlap rules to measure: N (a run of N prints), N/M (or M of another caller's prompt), "
        "-/M (M of another caller's prompt only: the default)",
    )
    parser.add_argument("--min-tokens", type=int, default=3, help="the reworded check's threshold")
    parser.add_argument("--judge-bodies", type=Path, help=argparse.SUPPRESS)  # one turn of --against
    args = parser.parse_args()
    if args.judge_bodies is not None:
        print(judge_rate(pickle.loads(args.judge_bodies.read_bytes())))
        return
    docs = corpus()
    print(f"corpus: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.1f} MB from /usr/share")
    if args.against is not None and args.overlap_only:
        forwarded = ["--exchanges", str(args.exchanges), "--callers", str(args.callers)]
        detection_against(args.against, [*forwarded, "--min-tokens", str(args.min_tokens)])
        return
    if args.against is not None:
        judge_against(docs, args.records, args.against, args.rounds)
        return
    if not args.overlap_only:
        print(f"judge: {bench_judge(docs, args.records):,.0f} records per CPU-second (batches of {BATCH})")
        for label, (p50, p99) in bench_tap(docs).items():
            print(f"tap: {label} exchange: p50 {p50:.2f} ms, p99 {p99:.2f} ms of work on the tap's thread")
    asked = hasattr(OverlapWindow, "longest_asked_run")  # not in older trees
    rules = [rule for rule in args.rules if asked or (rule.min_run and not rule.prompt_run)]
    sent, private = benign_traffic(docs, args.callers, args.exchanges)
    records = records_of(sent)
    overlaps = bench_overlap(sent, private, records, args.callers, rules)
    for rule, o in overlaps.items():
        recall = ", ".join(f"{n} words {r:.0%}" for n, r in o["recall"].items())
        print(f"overlap ({rule}): {_alarms(o, args.callers)}; recall on private leaked passages: "
              f"{recall}; {o['us_per_record']:.0f} µs of CPU a record")  # fmt: skip
    found = bench_reworded(sent, private, records, args.callers, args.min_tokens)
    if found is None:
        print("reworded: no such check in this tree")
        return
    recall = ", ".join(f"k={k} {r:.0%}" for k, r in found["recall"].items())
    alone = _words(recall_by(found["passages"], found["hits"]))
    cost = f"{found['us_per_record']:.0f} µs of CPU a record"
    print(f"reworded ({args.min_tokens} tokens): {_alarms(found, args.callers)}; recall on reworded "
          f"leaks of k private tokens: {recall}; on private leaked passages: {alone}; {cost}")  # fmt: skip
    for rule, o in overlaps.items():
        either = [a or b for a, b in zip(o["hits"], found["hits"], strict=True)]
        print(f"overlap ({rule}) or reworded: recall on private leaked passages: "
              f"{_words(recall_by(found['passages'], either))}")  # fmt: skip


def _words(recall: dict[int, float]) -> str:
    return ", ".join(f"{n} words {r:.0%}" for n, r in recall.items())


def _alarms(found: dict[str, Any], callers: int) -> str:
    kinds = ", ".join(f"{kind} {found['alarms'][kind]}/{n}" for kind, n in sorted(found["kinds"].items()))
    total, alarms = sum(found["kinds"].values()), sum(found["alarms"].values())
    return f"{alarms} false alarms in {total} benign exchanges of {callers} callers ({kinds})"


if __name__ == "__main__":
    main()
