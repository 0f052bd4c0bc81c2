"""Detection figures of the traffic checks, in one run, on traffic of real text nobody
here wrote (``bench/overlap_corpus.py``):

- ``overlap``: for each overlap rule asked (``--rules``: ``8`` is a run of 8 prints of anything,
  ``-/5`` a run of 5 prints one other caller alone asked (the settings' default), ``8/4`` either),
  its false alarms by kind on the benign traffic, its recall on private passages of 40, 80 and 200
  words leaked into another caller's answer, and its CPU time;
- ``reworded``: the reworded check's false alarms on the same traffic, its recall on reworded
  leaks of k = 3, 5, 8 private tokens and on the same private passages, and its CPU time;
- either check's recall on the private passages.

``KVCANARY_BENCH_TREE=<a checkout>`` measures that checkout's checks on the same traffic (the
rules its window knows); ``--against REV`` prints commit ``REV``'s figures and this working tree's,
one after the other, each tree in a process of its own. Throughput is ``bench/traffic.py``'s.

    .venv/bin/python bench/detection.py [--rules 8 -/4 8/4] [--exchanges 5000] [--callers 8]
    .venv/bin/python bench/detection.py --against HEAD
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

# The tree whose monitor is imported: this one, or (``--against``) the exported commit's.
sys.path.insert(0, os.environ.get("KVCANARY_BENCH_TREE") or str(Path(__file__).resolve().parent.parent))

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
from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.monitor.traffic.overlap import OverlapWindow
from kvcanary.tap.fingerprints import Fingerprinter

# The benign corpus and the throughput bench's helpers beside this file (after the tree: a tree
# measured by ``--against`` has neither).
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
from traffic import HERE, corpus, export

Leak = tuple[int, int, str]  # (victim, words, passage)


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
    sent: list[Sent], leaks: list[Leak], records: list[TrafficRecord], callers: int, rules: list[Rule],
    tap: Fingerprinter,
) -> dict[Rule, dict[str, Any]]:  # fmt: skip
    """For each rule: false alarms on the benign traffic (by kind) as the overlap check judges it,
    recall on private passages of 40, 80 and 200 words leaked to another caller (judged against
    the window the benign traffic left, marked as the tap marks them: a public text's print as
    its own), and the rule's CPU time per benign record."""
    exchanges = len(sent)
    asked, public = "Summarize our meeting notes, please.", getattr(tap, "public", frozenset())
    asked_fp = [tap.whole(asked)]
    leaked = [
        (v, n, [0 if f in public else f for f in tap.fingerprints("Sure. " + passage)[0]])
        for v, n, passage in leaks
    ]
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


def recall_by(leaks: list[Leak], hits: list[bool]) -> dict[int, float]:
    """Return the share of leaks caught, by the passage's length in words."""
    caught: dict[int, list[int]] = {n: [0, 0] for n in LEAK_WORDS}
    for (_, n, _), hit in zip(leaks, hits, strict=True):
        caught[n][0] += hit
        caught[n][1] += 1
    return {n: hit / total for n, (hit, total) in caught.items()}


def bench_reworded(
    sent: list[Sent], private: list[tuple[int, str]], leaks: list[Leak], records: list[TrafficRecord],
    callers: int, min_tokens: int,
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
    asked = tap.of("Summarize our meeting notes, please.")
    hits = [
        window.most_shared(f"c{(victim + 1) % callers}", asked, tap.exchange("", "Sure. " + passage)[1],
                           now, min_tokens).tokens >= min_tokens
        for victim, _, passage in leaks
    ]  # fmt: skip
    return {
        "alarms": alarms,
        "kinds": collections.Counter(s.kind for s in sent),
        "recall": {k: hit / total for k, (hit, total) in caught.items()},
        "hits": hits,  # each leak of ``leaks``, in order
        "us_per_record": took / len(records) * 1e6,
    }


def parse_rule(text: str) -> Rule:
    """``8`` (a run of 8 prints of anything), ``8/4`` (that, or 4 of another caller's prompt) or
    ``-/5`` (5 of another caller's prompt only: the settings' default)."""
    first, _, second = text.partition("/")
    return Rule(None if first == "-" else int(first), int(second) if second else None)


def detection_against(rev: str, forwarded: list[str]) -> None:
    """Print the detection figures (the default rules) of ``rev`` and of this
    working tree, one after the other, on the same traffic: each tree's checks in a process of
    its own, the corpus this file's."""
    with tempfile.TemporaryDirectory(prefix="kvcanary-bench-") as tmp:
        trees = {rev: export(rev, Path(tmp)), "working tree": HERE}
        for name, tree in trees.items():
            env = {**os.environ, "KVCANARY_BENCH_TREE": str(tree)}
            done = subprocess.run(
                [sys.executable, __file__, *forwarded],
                env=env, check=True, capture_output=True, text=True,
            )  # fmt: skip
            for line in done.stdout.splitlines():
                print(f"{name}: {line}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--callers", type=int, default=8)
    parser.add_argument("--exchanges", type=int, default=5000)
    parser.add_argument("--against", metavar="REV", help="commit REV's figures, then this tree's")
    parser.add_argument(
        "--rules",
        type=parse_rule,
        nargs="+",
        default=[Rule(OVERLAP_MIN_RUN), Rule(4), Rule(None, 4), Rule(None, 5), Rule(OVERLAP_MIN_RUN, 4)],
        help="overlap rules to measure: N (a run of N prints), N/M (or M of another caller's prompt), "
        "-/M (M of another caller's prompt only: the default)",
    )
    parser.add_argument("--min-tokens", type=int, default=3, help="the reworded check's threshold")
    parser.add_argument(
        "--public-texts", nargs="*", default=[], metavar="PATH",
        help="files or folders the tap is told are public (KVCANARY_TAP_PUBLIC_TEXTS), e.g. "
        "/usr/share/common-licenses",
    )  # fmt: skip
    args = parser.parse_args()
    if args.against is not None:
        forwarded = ["--exchanges", str(args.exchanges), "--callers", str(args.callers)]
        forwarded += ["--public-texts", *args.public_texts] if args.public_texts else []
        detection_against(args.against, [*forwarded, "--min-tokens", str(args.min_tokens)])
        return
    docs = corpus()
    print(f"corpus: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.1f} MB from /usr/share")
    asked = hasattr(OverlapWindow, "longest_asked_run")  # not in older trees
    rules = [rule for rule in args.rules if asked or (rule.min_run and not rule.prompt_run)]
    sent, private = benign_traffic(docs, args.callers, args.exchanges)
    tap, public = public_tap(args.public_texts)
    records, leaks = records_of(sent, tap), private_leaks(sent, private, args.callers, public)
    overlaps = bench_overlap(sent, leaks, records, args.callers, rules, tap)
    for rule, o in overlaps.items():
        print(f"overlap ({rule}): {_alarms(o, args.callers)}; recall on private leaked passages: "
              f"{_words(o['recall'])}; {o['us_per_record']:.0f} µs of CPU a record")  # fmt: skip
    found = bench_reworded(sent, private, leaks, records, args.callers, args.min_tokens)
    if found is None:
        print("reworded: no such check in this tree")
        return
    recall = ", ".join(f"k={k} {r:.0%}" for k, r in found["recall"].items())
    alone = _words(recall_by(leaks, found["hits"]))
    cost = f"{found['us_per_record']:.0f} µs of CPU a record"
    print(f"reworded ({args.min_tokens} tokens): {_alarms(found, args.callers)}; recall on reworded "
          f"leaks of k private tokens: {recall}; on private leaked passages: {alone}; {cost}")  # fmt: skip
    for rule, o in overlaps.items():
        either = [a or b for a, b in zip(o["hits"], found["hits"], strict=True)]
        print(f"overlap ({rule}) or reworded: recall on private leaked passages: "
              f"{_words(recall_by(leaks, either))}")  # fmt: skip


def public_tap(paths: list[str]) -> tuple[Fingerprinter, list[str]]:
    """The tap's fingerprints under the bench's key, told the public texts at ``paths`` (a tree
    whose tap cannot be told any says so), and those texts: no leak is made of them."""
    tap = Fingerprinter(KEY)
    files = [f for p in map(Path, paths) for f in ([p] if p.is_file() else sorted(p.rglob("*")))]
    texts = [f.read_text(errors="replace") for f in files if f.is_file()]
    if not texts:
        return tap, []
    try:
        from kvcanary.tap.public import public_prints, tell
    except ImportError:
        print("public texts: this tree's tap cannot be told any")
        return tap, texts
    known = public_prints(texts, tap)
    tell(tap, known)
    print(f"public texts: {known.files} files, {len(known.prints)} prints and {len(known.tokens)} "
          "distinctive tokens, told to the tap")  # fmt: skip
    return tap, texts


def _words(recall: dict[int, float]) -> str:
    return ", ".join(f"{n} words {r:.0%}" for n, r in recall.items())


def _alarms(found: dict[str, Any], callers: int) -> str:
    kinds = ", ".join(f"{kind} {found['alarms'][kind]}/{n}" for kind, n in sorted(found["kinds"].items()))
    total, alarms = sum(found["kinds"].values()), sum(found["alarms"].values())
    return f"{alarms} false alarms in {total} benign exchanges of {callers} callers ({kinds})"


if __name__ == "__main__":
    main()
