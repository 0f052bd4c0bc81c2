"""Prefill and decode reference servers as real processes, and the gateway's side of their protocol.

The sizes are the incident's at toy scale (``tests.workers.support``): a prefill pool of 1,024
tokens under an 8,192-token context window, decode pools of 4,096. Every server knows the keys
``sk-a`` → tenant-a and ``sk-b`` → tenant-b.
"""

from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvcanary.processes import free_port, stop_processes
from tests.support import WorkerProcess, launch_worker, wait_worker
from tests.workers.support import MODEL

KEYS = ("--api-key", "sk-a=tenant-a", "--api-key", "sk-b=tenant-b")
COMMON = ("--page-size", "16", "--context-window", "8192", "--max-batch", "16", *KEYS)
PREFILL_POOL = ("--prefill-pool-tokens", "1024")
DECODE_POOL = ("--decode-pool-tokens", "4096")


@dataclass
class PrefillServer:
    """A ``--mode prefill`` worker and the port its decode servers fetch K/V from."""

    worker: WorkerProcess
    bootstrap_port: int

    @property
    def url(self) -> str:
        return self.worker.url


def prefill_flags(bootstrap_port: int, admission: str, *more: str) -> list[str]:
    """Return the flags of a prefill server on the small pool with ``admission``."""
    return [
        "--mode", "prefill", "--bootstrap-port", str(bootstrap_port), "--admission", admission,
        *PREFILL_POOL, *COMMON, *more,
    ]  # fmt: skip


def decode_flags(*more: str) -> list[str]:
    """Return the flags of a decode server on the small pool."""
    return ["--mode", "decode", *DECODE_POOL, *COMMON, *more]


def start_servers(
    log_dir: Path, prefills: dict[str, tuple[str, ...]], decodes: dict[str, tuple[str, ...]]
) -> tuple[dict[str, PrefillServer], dict[str, WorkerProcess]]:
    """Start every server at once (their startups overlap) and wait for all: ``prefills`` maps a
    name to (admission, more flags...), ``decodes`` a name to more flags."""
    started_prefills = {}
    for name, (admission, *more) in prefills.items():
        port = free_port()
        started_prefills[name] = PrefillServer(
            launch_worker(prefill_flags(port, admission, *more), log_dir), port
        )
    started_decodes = {name: launch_worker(decode_flags(*more), log_dir) for name, more in decodes.items()}
    everyone = [p.worker for p in started_prefills.values()] + list(started_decodes.values())
    try:
        for worker in everyone:
            wait_worker(worker)
    except BaseException:
        stop_processes([w.proc for w in everyone])
        raise
    return started_prefills, started_decodes


def stop_servers(prefills: dict[str, PrefillServer], decodes: dict[str, WorkerProcess]) -> None:
    """Stop every server at once."""
    stop_processes([p.worker.proc for p in prefills.values()] + [d.proc for d in decodes.values()])


def pd_body(prompt: str, prefill: PrefillServer, room: int | None = None, **fields: Any) -> dict[str, Any]:
    """Return a completion body as the gateway sends it to both servers (a new random room unless told)."""
    return {
        "model": MODEL,
        "prompt": prompt,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": secrets.randbits(63) if room is None else room,
        **fields,
    }


def as_gateway(
    prefill: PrefillServer, decode: WorkerProcess, body: dict[str, Any], key: str = "sk-a"
) -> tuple[httpx.Response, httpx.Response]:
    """Send ``body`` to the prefill and the decode server at the same time, as the gateway does;
    return (prefill's answer, decode's answer)."""
    headers = {"Authorization": f"Bearer {key}"}
    with ThreadPoolExecutor(2) as pool:
        answers = [
            pool.submit(httpx.post, f"{url}/v1/completions", json=body, headers=headers, timeout=60)
            for url in (prefill.url, decode.url)
        ]
        return answers[0].result(), answers[1].result()


def metric(url: str, name: str, **labels: str) -> float:
    """Return one sample of a server's /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0
