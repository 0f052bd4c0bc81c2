"""Which probe kinds catch which bug-zoo defect, and how many trigger events a kind needs to.

    .venv/bin/python bench/bug_zoo.py matrix [--runs 3] [--kinds canary,...] [--defects NAME,...]
    .venv/bin/python bench/bug_zoo.py rates [--rates 0.5,0.2,0.1] [--seeds 3] [--max-runs 40] [--defects ...]

Both drive real reference workers (``python -m kvcanary.workers``, one process per configuration, on
loopback) through the monitor's own target client and ``execute_probe``, as ``kvcanary serve`` runs
a kind, two tenants, a 15 s request timeout (5 s for ``duplicate_ids``: ``rid-collision`` leaves
one request hanging until it).

- **matrix**: every kind ``--runs`` times against each defect's worker (``--bug NAME``) and against
  the same worker without the flag (the fix); prints a markdown table of verdicts (docs/performance.md).
- **rates**: for each defect and each ``--rates`` value ``p`` (``--bug-rate p``: the defect acts on
  a fraction ``p`` of its trigger events), runs the kind that targets it until its first catch
  (a ``leak``; a ``mismatch`` where that is what the defect produces) and reads the trigger events
  the worker counted (``kvcanary_bug_trigger_events_total``) by then, over ``--seeds`` seeds;
  prints the median and worst against the goal of ``3/p`` events, and how many of them the defect
  acted on (``kvcanary_bug_fired_total``: 1 means the first firing was caught). Events are counted
  to the end of the catching run, so the figure is an upper bound.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from kvcanary.monitor.config.targets import TargetConfig  # noqa: E402  (run as a script from the repository)
from kvcanary.monitor.runs.execute import execute_probe  # noqa: E402
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget  # noqa: E402
from kvcanary.monitor.targets.scrape import parse_samples  # noqa: E402
from kvcanary.probes.base import Verdict  # noqa: E402
from kvcanary.probes.markers import MarkerBook  # noqa: E402
from kvcanary.processes import free_port  # noqa: E402

KEYS = {"alice": "bench-key-alice", "bob": "bench-key-bob"}
BASE = ("--mode", "aggregated", "--kv-pool-tokens", "8192", "--page-size", "16", "--context-window", "8192")
ADAPTERS = ("sql-lora", "chat-lora")
#: defect -> (the worker flags it needs besides BASE, the kind that recreates its trigger)
DEFECTS: dict[str, tuple[tuple[str, ...], str]] = {
    "rid-collision": ((), "duplicate_ids"),
    "prefix-key-partial": (("--prefix-cache", "shared"), "shared_prefix"),
    "prefix-key-no-adapter": (
        ("--prefix-cache", "shared", *(arg for name in ADAPTERS for arg in ("--lora-adapter", name))),
        "shared_prefix",
    ),
    "abort-in-flight": ((), "hangup"),
    "session-restore": (("--session-cache", "8"), "session"),
    "batch-crossed": (("--max-batch", "16"), "full_batch"),
    "slot-stale-tokens": ((), "slot_reuse"),
    # The reasoning-end string lets full_batch send thinking rows and judge the others for it.
    "sampling-rows-stale": (("--max-batch", "16", "--reasoning-end-str", "</think>"), "full_batch"),
    "session-offload-chunks": (("--session-cache", "8"), "session"),
    # Four ring slots: the salt check pushes its prefix into the offload tier within its budget.
    "offload-salt-dropped": (("--session-cache", "4"), "prefix_cache"),
    "salt-body-over-header": (
        ("--prefix-cache", "per-tenant", "--cache-salt-header", "x-tenant-id"),
        "prefix_cache",
    ),
}
#: Defects no per-worker column can hold, and where each is caught instead.
NOT_IN_THE_MATRIX = {
    "pd-transfer-corrupt": "a prefill node's hand-off to a decode node: the capacity audit reads the decode "
    "node's checksum failures (tests/probes/test_counters.py, tests/workers/test_pd_checksum.py)",
}
#: Request timeouts: 15 s, but 5 s where the defect leaves a request hanging until it (rid-collision).
TIMEOUTS = {"duplicate_ids": 5.0}
KINDS = ("canary", "cross_tenant", "boundary", "needle", *dict.fromkeys(kind for _, kind in DEFECTS.values()))


@contextmanager
def worker(*flags: str) -> Iterator[str]:
    """Run a reference worker with ``flags`` and the tenants' keys; yield its URL."""
    port = free_port()
    keys = [arg for tenant, key in KEYS.items() for arg in ("--api-key", f"{key}={tenant}")]
    argv = [sys.executable, "-m", "kvcanary.workers", "--port", str(port), *flags, *keys]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180  # torch's import alone took over a minute on a loaded 2-core run
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"worker {' '.join(flags)} did not start")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # a request the defect left hanging holds the shutdown up
            proc.kill()
            proc.wait()


def run_kind(url: str, kind: str, flags: tuple[str, ...] = ()) -> Verdict:
    """Run ``kind`` once against a worker started with ``flags``, told what they serve: its adapters
    (:data:`ADAPTERS`, which shared_prefix asks) and its reasoning-end string (full_batch's)."""
    options: dict[str, dict[str, Any]] = {}
    if "--lora-adapter" in flags:
        options["shared_prefix"] = {"adapters": list(ADAPTERS)}
    if "--session-cache" in flags or _flag(flags, "--prefix-cache") == "shared":
        # Both are shared across tenants on purpose (the session cache keys by salt, not tenant), as
        # an operator who runs them says: a hit across tenants is then the policy, not a leak.
        options["prefix_cache"] = {"policy": "shared"}
    if "--reasoning-end-str" in flags:
        options["full_batch"] = {"reasoning_end": _flag(flags, "--reasoning-end-str")}
    config = TargetConfig(
        name="zoo", base_url=url, engine="reference", model="kvcanary-reference",
        tenants=[{"name": t} for t in KEYS], timeout_seconds=TIMEOUTS.get(kind, 15), probes=[kind],
        options=options,
    )  # fmt: skip

    async def go() -> Verdict:
        async with OpenAIHttpTarget(config, dict(KEYS)) as target:
            result, _ = await execute_probe(kind, target, MarkerBook(), config)
        return result.verdict

    return asyncio.run(go())


def _flag(flags: tuple[str, ...], name: str) -> str | None:
    """Return the value given to ``name`` in ``flags``, or None where it is not given."""
    return flags[flags.index(name) + 1] if name in flags else None


def cell(verdicts: list[Verdict]) -> str:
    counts = Counter(v.value for v in verdicts)
    order = ("leak", "mismatch", "error", "pass")
    return ", ".join(f"{name} {counts[name]}/{len(verdicts)}" for name in order if counts[name])


def matrix(runs: int, kinds: list[str], defects: list[str]) -> None:
    columns: dict[str, dict[str, list[Verdict]]] = {}
    fixed: dict[str, list[Verdict]] = {kind: [] for kind in kinds}
    for defect in defects:
        flags = DEFECTS[defect][0]
        with worker(*BASE, *flags, "--bug", defect) as url:
            columns[defect] = {kind: [run_kind(url, kind, flags) for _ in range(runs)] for kind in kinds}
        with worker(*BASE, *flags) as url:
            for kind in kinds:
                fixed[kind] += [run_kind(url, kind, flags) for _ in range(runs)]
        print(f"# {defect} done", file=sys.stderr, flush=True)
    print("| kind | " + " | ".join(f"`{d}`" for d in defects) + " | fixed (each worker without its flag) |")
    print("|---|" + "---|" * (len(defects) + 1))
    for kind in kinds:
        row = [cell(columns[d][kind]) for d in defects] + [cell(fixed[kind])]
        print(f"| `{kind}` | " + " | ".join(row) + " |")
    for defect, where in NOT_IN_THE_MATRIX.items():
        print(f"\n`{defect}` is not a column: {where}.")


def events(url: str, defect: str) -> tuple[float, float]:
    """Return the trigger events the worker counted for ``defect`` and those the defect acted on."""
    samples = parse_samples(httpx.get(f"{url}/metrics", timeout=5).text)
    label = f'{{bug="{defect}"}}'
    return (
        samples.get(f"kvcanary_bug_trigger_events_total{label}", 0.0),
        samples.get(f"kvcanary_bug_fired_total{label}", 0.0),
    )


def first_catch(defect: str, rate: float, seed: int, max_runs: int) -> tuple[float, float, float, int] | None:
    """Return (trigger events, firings, seconds, runs) until the defect's kind first caught it, or None."""
    flags, kind = DEFECTS[defect]
    with worker(*BASE, *flags, "--bug", defect, "--bug-rate", str(rate), "--seed", str(seed)) as url:
        started = time.monotonic()
        for run in range(1, max_runs + 1):
            if run_kind(url, kind, flags) in (Verdict.LEAK, Verdict.MISMATCH):
                return (*events(url, defect), time.monotonic() - started, run)
    return None


def rates(values: list[float], seeds: int, max_runs: int, defects: list[str]) -> None:
    head = "| defect (kind) | p | trigger events to the first catch: median / worst | goal 3/p |"
    print(head + " firings by then: median / worst | seconds: median | runs: median |")
    print("|---|---|---|---|---|---|---|")
    for defect in defects:
        kind = DEFECTS[defect][1]
        for p in values:
            found = [first_catch(defect, p, seed, max_runs) for seed in range(seeds)]
            caught = [f for f in found if f is not None]
            missed = len(found) - len(caught)
            ev = [f[0] for f in caught]
            summary = f"{statistics.median(ev):g} / {max(ev):g}" if ev else "never"
            if missed:
                summary += f" ({missed} of {seeds} not caught in {max_runs} runs)"
            fired = [f[1] for f in caught]
            firings = f"{statistics.median(fired):g} / {max(fired):g}" if fired else "-"
            secs = f"{statistics.median(f[2] for f in caught):.1f}" if caught else "-"
            runs = f"{statistics.median(f[3] for f in caught):g}" if caught else "-"
            cells = (f"`{defect}` (`{kind}`)", f"{p:g}", summary, str(math.ceil(3 / p)), firings, secs, runs)
            print("| " + " | ".join(cells) + " |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("matrix")
    m.add_argument("--runs", type=int, default=3)
    m.add_argument("--kinds", default=",".join(KINDS))
    r = sub.add_parser("rates")
    r.add_argument("--rates", default="0.5,0.2,0.1")
    r.add_argument("--seeds", type=int, default=3)
    r.add_argument("--max-runs", type=int, default=40)
    for command in (m, r):
        command.add_argument("--defects", default=",".join(DEFECTS))
    args = parser.parse_args(argv)
    defects = args.defects.split(",")
    unknown = sorted(set(defects) - set(DEFECTS))
    for defect in set(unknown) & set(NOT_IN_THE_MATRIX):
        parser.error(f"--defects: {defect} is not a column: {NOT_IN_THE_MATRIX[defect]}")
    if unknown:
        parser.error(f"--defects: unknown {', '.join(unknown)} (known: {', '.join(DEFECTS)})")
    if args.command == "matrix":
        matrix(args.runs, args.kinds.split(","), defects)
    else:
        rates([float(v) for v in args.rates.split(",")], args.seeds, args.max_runs, defects)
    return 0


if __name__ == "__main__":
    sys.exit(main())
