"""What SGLang's own KV canary (``--kv-canary log``) costs a request on this CPU, measured as a ratio.

Two SGLang 0.5.23 servers on the tests' tiny model (``tests/sglang/server.py``), one with the canary
and one without, both running at once; each round sends the same new prompt to both, one after the
other, the order rotating, so both see the same load from everything else. A round's ratio is
canary_time / plain_time; the result is the median ratio. On a CPU the canary's checks run as
SGLang's torch references (its CUDA kernels need a GPU): the figure says what the opt-in tests pay
here, not what a GPU deployment pays. Needs ``bash scripts/setup-sglang.sh``; the result is printed
last, as one line: ``kv-canary cost: X.Xx the time of a request without it``.

Usage: ``KVCANARY_SGLANG_VENV=~/.cache/kvcanary/venv-sglang python bench/sglang_canary.py [--rounds 15]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.sglang.server import SglangServer, make_model, python_of_a_built_venv, start_server
from tests.support import stop_processes


def timed_completion(server: SglangServer, prompt: str, tokens: int) -> float:
    started = time.perf_counter()
    body = {"model": server.model_name, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    answer.raise_for_status()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=16, help="tokens generated a request (default: %(default)s)")
    args = p.parse_args(argv)
    python = python_of_a_built_venv()
    make_model(python)
    folder = Path(tempfile.mkdtemp(prefix="kvcanary-bench-sglang-"))
    # An idle SGLang scheduler polls without pause unless told to sleep: the other server's turn
    # would pay for it.
    plain, plain_proc, failure = start_server(python, folder, "--sleep-on-idle")
    canary, canary_proc, failure_canary = start_server(
        python, folder, "--sleep-on-idle", "--kv-canary", "log"
    )
    try:
        if plain_proc is None or canary_proc is None:
            sys.exit(f"a server did not start:\n{failure}{failure_canary}")
        ratios, times = [], {"plain": [], "canary": []}
        for round_ in range(args.rounds):
            prompt = f"round {round_}: " + "the page table " * 40  # new each round: no whole-prompt cache hit
            pair = [("plain", plain), ("canary", canary)]
            took = {
                name: timed_completion(server, prompt, args.tokens)
                for name, server in pair[:: 1 - 2 * (round_ % 2)]
            }
            for name, seconds in took.items():
                times[name].append(seconds)
            ratios.append(took["canary"] / took["plain"])
        for name, seconds in times.items():
            print(
                f"{name}: median {statistics.median(seconds) * 1000:.0f} ms a request of {args.tokens} tokens"
            )
        print(f"ratios: min {min(ratios):.1f} max {max(ratios):.1f} over {args.rounds} rounds")
        print(f"kv-canary cost: {statistics.median(ratios):.1f}x the time of a request without it")
    finally:
        stop_processes([proc for proc in (plain_proc, canary_proc) if proc is not None], timeout=30)


if __name__ == "__main__":
    main()
