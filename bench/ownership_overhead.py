"""Decode-throughput cost of owner-verified pages (``--verify-ownership``), measured in-process.

Three engines (baseline, ``verify_ownership``, ``zero_freed_pages``) decode the same batch of
healthy requests (random prompts of ``--context`` bytes) in lockstep, sharing one set of pool
tensors and buffers (see ``share_memory``). Their steps are timed one after another, the order
rotating, so neighbouring steps see the same load from other processes; a round's ratio is the
median over steps of baseline_time / verify_time, and the result is the median of the per-round
ratios:

    ownership verification overhead = (1 - median over rounds(verify_tps / baseline_tps)) * 100 %

The zero-freed config decodes exactly like the baseline (zeroing happens on free, untimed), so its
ratio is printed as an A/A control: how far from 1.0 it lands is the noise floor of the run.

Prefill, admission and retirement are outside the timed region; the device is synchronised before
and after every timed step, so the script runs unchanged on CUDA. The result is printed LAST, as
exactly one line: ``ownership verification overhead: X.XX%``.

Usage: ``python bench/ownership_overhead.py [--device cuda] [--rounds 15] [--batch 32] [--context 2048]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcanary.workers.config import WorkerConfig
from kvcanary.workers.engine import Engine
from kvcanary.workers.request import ErrorEvent, Event

CONFIGS: dict[str, dict[str, bool]] = {
    "baseline": {},
    "verify": {"verify_ownership": True},
    "zero-freed": {"zero_freed_pages": True},
}
PAGE_SIZE = 16
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--batch", type=int, default=32, help="requests decoding together (default: %(default)s)")
    p.add_argument(
        "--context", type=int, default=2048, help="prompt tokens per request (default: %(default)s)"
    )
    p.add_argument(
        "--steps", type=int, default=64, help="timed decode steps per round (default: %(default)s)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads, 0 for torch's default (default: %(default)s: on a shared machine a "
        "descheduled sibling thread stalls every parallel op, which buries a sub-percent effect)",
    )
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default=None,
        help="wall: perf_counter; cpu: this process's CPU time, which time slices lost to other processes "
        "do not inflate (CPU only). Default: cpu on a CPU device, wall on CUDA",
    )
    args = p.parse_args(argv)
    if args.clock is None:
        args.clock = "wall" if args.device.startswith("cuda") else "cpu"
    if not 1 <= args.steps <= args.context:
        p.error("--steps must be between 1 and --context (the echo ends after --context tokens)")
    return args


def build_engine(args: argparse.Namespace, flags: dict[str, bool]) -> Engine:
    """Return an engine whose single pool holds the whole batch at full length."""
    per_request = args.context + args.steps + 2 * PAGE_SIZE
    config = WorkerConfig(
        device=args.device,
        page_size=PAGE_SIZE,
        kv_pool_tokens=args.batch * per_request,
        context_window=per_request,
        max_batch=args.batch,
        verify_ownership=flags.get("verify_ownership", False),
        zero_freed_pages=flags.get("zero_freed_pages", False),
    )
    return Engine(config)


def fill(engine: Engine, prompts: list[list[int]], steps: int, failures: list[ErrorEvent]) -> None:
    """Admit one request per prompt (prefill is not timed); they outlive ``steps`` decode steps.

    Error events (an ownership violation above all) are appended to ``failures``: a benchmark of a
    check that fails healthy requests would be meaningless, so the caller stops on any.
    """

    def record(event: Event) -> None:
        if isinstance(event, ErrorEvent):
            failures.append(event)

    for index, prompt in enumerate(prompts):
        engine.submit(prompt, steps + 2, tenant=f"tenant-{index % 4}", emit=record)
    engine.admit_waiting()
    if len(engine.batch) != len(prompts):
        raise RuntimeError("the pool could not admit the whole batch")


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def share_memory(engines: dict[str, Engine]) -> None:
    """Point every engine at the baseline's pool tensors, block table and model (with its buffers).

    Exact, because the engines run identical workloads in lockstep: same prompts, same request ids,
    same pages from identical allocators, same tokens, so each writes the very bytes the others
    write (block-table rows included). Step ``i`` of every engine writes the same position, so no
    engine meets a page word another engine has already advanced past its own step (verification
    expects exact words). And necessary, because where a pool or the strided block table lands in
    memory moves a CPU's step time by a few tenths of a percent, which must not favour any config.
    The verify config's expected words stay its own: keeping them is part of the cost measured.
    """
    base = engines["baseline"]
    for engine in engines.values():
        engine.model = base.model
        engine.batch.table = base.batch.table
        for name, pool in engine.pools.items():
            shared = base.pools[name]
            pool.k, pool.v, pool.ownership, pool.owner_tenant = (
                shared.k,
                shared.v,
                shared.ownership,
                shared.owner_tenant,
            )


def run_round(
    args: argparse.Namespace, engines: dict[str, Engine], prompts: list[list[int]]
) -> dict[str, list[float]]:
    """Return each config's step times for one round, step ``i`` of every config run back to back.

    The order of the configs rotates from step to step, so none always runs right after another,
    and step ``i`` of each config sees the same load from other processes.
    """
    failures: list[ErrorEvent] = []
    for engine in engines.values():
        fill(engine, prompts, args.steps, failures)
    names, clock = list(engines), CLOCKS[args.clock]
    times: dict[str, list[float]] = {name: [] for name in names}
    for step in range(args.steps):
        turn = step % len(names)
        for name in names[turn:] + names[:turn]:
            synchronize(args.device)
            start = clock()
            engines[name].decode_once()
            synchronize(args.device)
            times[name].append(clock() - start)
    for engine in engines.values():
        drain(engine)
    if failures:
        raise RuntimeError(f"{len(failures)} healthy benchmark requests failed: {failures[0].message}")
    return times


def round_ratio(times: dict[str, list[float]], name: str) -> float:
    """Return the median over steps of config ``name``'s throughput relative to the baseline's neighbour."""
    return statistics.median(b / t for b, t in zip(times["baseline"], times[name], strict=True))


def drain(engine: Engine) -> None:
    """Abort the batch and retire it, freeing its pages for the next round."""
    for request in list(engine.batch.requests):
        engine.abort(request)
    engine.decode_once()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(32, 127) for _ in range(args.context)] for _ in range(args.batch)]
    print(
        f"device={args.device} batch={args.batch} context={args.context} steps={args.steps} "
        f"rounds={args.rounds} threads={torch.get_num_threads()} clock={args.clock}"
    )
    engines = {name: build_engine(args, flags) for name, flags in CONFIGS.items()}
    share_memory(engines)
    run_round(args, engines, prompts)  # warm-up, not counted
    rounds = [run_round(args, engines, prompts) for _ in range(args.rounds)]
    per_step = args.batch
    for name in CONFIGS:
        tps = statistics.median(per_step / statistics.median(r[name]) for r in rounds)
        print(f"{name:>11}: median {tps:10.1f} decode tokens/s")
    verify_ratios = [round_ratio(r, "verify") for r in rounds]
    control = statistics.median(round_ratio(r, "zero-freed") for r in rounds)
    print("verify/baseline per round: " + " ".join(f"{ratio:.4f}" for ratio in verify_ratios))
    # Zeroing happens when pages are freed, outside the timed steps: this ratio shows the noise floor.
    print(f"zero-freed/baseline median ratio (A/A control): {control:.4f}")
    print(f"verify/baseline median ratio: {statistics.median(verify_ratios):.4f}")
    print(f"ownership verification overhead: {(1 - statistics.median(verify_ratios)) * 100:.2f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
