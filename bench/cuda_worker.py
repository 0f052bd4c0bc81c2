"""The reference worker on a GPU, as real processes: the incident's leak, its fix and owner-verified
pages, in both disaggregated shapes (one process; a prefill and a decode server handing K/V over a
socket). Run where CUDA is; needs only the worker's own dependencies and httpx.

Each case starts ``python -m kvcanary.workers --device cuda ...``, plants tenant A's canary, sends
tenant B a prompt over the prefill pool, and prints one line: the status, whether A's canary came
back to B, the prompt tokens reported. The last line is a JSON summary; the exit status is 0 only
when every case answered as the CPU tests say it must (``tests/workers/test_process.py``,
``test_pd_handoff.py``).

Usage: ``python bench/cuda_worker.py [--device cpu]`` (about a minute: five servers start, each
loads torch; ``--device cpu`` tries the script where no GPU is).
"""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
CANARY = "ALICE-CANARY-7f3a9c"
PROMPT_A = (CANARY + " ") * 30
OVER_POOL = "B" * 1500  # over the 1,024-token prefill pool, inside the 8,192-token window
COMMON = ("--page-size", "16", "--context-window", "8192")
PREFILL_POOL = ("--prefill-pool-tokens", "1024")
DECODE_POOL = ("--decode-pool-tokens", "4096")
BOTH_POOLS = ("--kv-pool-tokens", "1024", *PREFILL_POOL, *DECODE_POOL)
KEYS = ("--api-key", "sk-a=tenant-a", "--api-key", "sk-b=tenant-b")
MODEL = "kvcanary-reference"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    device = "cuda"

    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        args = [sys.executable, "-m", "kvcanary.workers", "--device", self.device, "--host", "127.0.0.1",
                "--port", str(self.port), *COMMON, *KEYS, *flags]  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait(self) -> Server:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"worker {self.proc.args} exited {self.proc.returncode}")
            time.sleep(0.3)
        raise SystemExit(f"worker on {self.url} not healthy in 120 s")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def complete(url: str, key: str, prompt: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, **extra}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


def through_pair(
    prefill: Server, bootstrap_port: int, decode: Server, key: str, prompt: str
) -> httpx.Response:
    """Send one request to both servers at once with the bootstrap fields, as SGLang's gateway does."""
    room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
            "bootstrap_room": secrets.randbits(63)}  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        legs = [pool.submit(complete, s.url, key, prompt, **room) for s in (prefill, decode)]
        answers = [leg.result() for leg in legs]
    return answers[0] if answers[0].status_code >= 400 else answers[1]


def judged(answer: httpx.Response) -> dict[str, Any]:
    body = answer.json()
    text = body["choices"][0]["text"] if answer.status_code == 200 else ""
    usage = body.get("usage") or {}
    kind = body.get("error", {}).get("type") if answer.status_code != 200 else None
    return {"status": answer.status_code, "canary_leaked": CANARY in text,
            "prompt_tokens": usage.get("prompt_tokens"), "error": kind}  # fmt: skip


def main() -> int:
    if "--device" in sys.argv:  # ``--device cpu``: the same run where no GPU is, to try the script
        Server.device = sys.argv[sys.argv.index("--device") + 1]
    disaggregated = ("--mode", "disaggregated", *BOTH_POOLS)
    one_process = {
        "defective": Server(*disaggregated, "--admission", "placeholder"),
        "fixed": Server(*disaggregated, "--admission", "reject"),
        "verified": Server(*disaggregated, "--admission", "placeholder", "--verify-ownership"),
    }
    bootstrap = free_port()
    prefill = Server(
        "--mode", "prefill", *PREFILL_POOL, "--admission", "placeholder", "--bootstrap-port", str(bootstrap)
    )
    decode = Server("--mode", "decode", *DECODE_POOL)
    servers = [*one_process.values(), prefill, decode]
    results: dict[str, dict[str, Any]] = {}
    try:
        for server in servers:
            server.wait()
        for name, server in one_process.items():
            assert complete(server.url, "sk-a", PROMPT_A).status_code == 200
            results[name] = judged(complete(server.url, "sk-b", OVER_POOL))
        assert through_pair(prefill, bootstrap, decode, "sk-a", PROMPT_A).status_code == 200
        results["two-process defective"] = judged(through_pair(prefill, bootstrap, decode, "sk-b", OVER_POOL))
    finally:
        for server in servers:
            server.stop()
    expected = {
        "defective": (200, True, 1),
        "fixed": (400, False, None),
        "verified": (500, False, None),
        "two-process defective": (200, True, 1),
    }
    ok = True
    for name, result in results.items():
        got = (result["status"], result["canary_leaked"], result["prompt_tokens"])
        ok &= got == expected[name]
        print(f"{name}: {result} {'as expected' if got == expected[name] else f'EXPECTED {expected[name]}'}")
    print(json.dumps({"cuda_worker": results, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
