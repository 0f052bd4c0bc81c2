"""The tap's added time per request inside a real LiteLLM proxy, beside the proxy's own.

Three paths to the same backend, measured in one run, sequential requests of 1 KB, 16 KB and 1 MB
exchanges (three quarters prompt, one quarter answer), p50 and p99 in milliseconds:

- ``direct``: the backend itself;
- ``proxy``: through LiteLLM 1.110.2 without the tap (the proxy's own overhead: direct to proxy);
- ``proxy+noop``: through LiteLLM with a logging callback that does nothing (what any logging
  callback costs there: LiteLLM builds its logging payload once one is registered);
- ``proxy+tap``: through LiteLLM with ``kvcanary.tap.litellm.tap`` posting to a sink;
- ``proxy+tap+q``: the same with the quarantine filter and the admission guard on
  (``KVCANARY_TAP_QUARANTINE=1``), the sink serving a set of 50 quarantined deployments,
  none of them this group's, and a guard on this group's deployment whose pool (a million tokens)
  holds every prompt sent: what the two add to every request that they let through.

The backend is a small OpenAI-shaped server that answers at once with a reply of the asked size,
and the sink takes every batch: what is timed is the gateway, not an engine or a monitor.
LiteLLM's venv comes from ``scripts/setup-litellm.sh`` (``$KVCANARY_LITELLM_VENV``).

    .venv/bin/python bench/tap_litellm.py [--requests 200]
"""

from __future__ import annotations

import argparse
import http.server
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from tests.support import stop_process
from tests.support.litellm import CALLERS, litellm_ready, start_proxy
from tests.support.signing import SigningKeys, document, make_keys

NOOP = "from litellm.integrations.custom_logger import CustomLogger\n\nnoop = CustomLogger()\n"
SIZES = {"1KB": 1024, "16KB": 16 * 1024, "1MB": 1024 * 1024}
#: 50 quarantined deployments on other hosts: the filter looks each of the group's up and keeps it.
QUARANTINE_SET: dict[str, object] = {
    **document(expires_seconds=86400),
    "deployments": [
        {"target": f"t{i}", "api_bases": [f"http://10.9.0.{i}:8000"], "enforced": True, "incident_id": i,
         "reason": "bench", "since": "2026-12-03T12:00:00Z"}
        for i in range(50)
    ],
}  # fmt: skip
#: The set is served signed, as a monitor serves it: the taps check it (set in main).
SIGNING: list[SigningKeys] = []
TEXT = Path("/usr/share/common-licenses/GPL-3").read_text() * 40


class Backend(http.server.BaseHTTPRequestHandler):
    """An OpenAI-shaped chat endpoint: the answer is ``max_tokens`` characters of licence text."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else keep-alive requests stall on delayed ACKs

    def do_GET(self) -> None:  # /v1/models, /health; the monitor's quarantine set
        if self.path.startswith("/api/v1/quarantine"):
            self._send_bytes(SIGNING[0].signer.sign(QUARANTINE_SET))
            return
        self._send({"data": [{"id": "m"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        if self.path.endswith("/traffic"):  # the sink: the monitor's ingest
            self._send({"accepted": len(body.get("records", []))})
            return
        reply = TEXT[: int(body.get("max_tokens", 16))]
        self._send({
            "id": "chatcmpl-b", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": len(reply), "total_tokens": 10 + len(reply)},
        })  # fmt: skip

    def _send(self, obj: object) -> None:
        self._send_bytes(json.dumps(obj).encode())

    def _send_bytes(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def serve() -> str:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Backend)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def timings(url: str, key: str, size: int, n: int) -> tuple[float, float]:
    prompt = TEXT[: size * 3 // 4]
    body = {"model": "shop", "messages": [{"role": "user", "content": prompt}], "max_tokens": size // 4}
    took = []
    with httpx.Client(timeout=120) as client:
        for i in range(n + 3):
            start = time.perf_counter()
            answer = client.post(
                f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )
            answer.raise_for_status()
            if i >= 3:  # warm-up: connections, LiteLLM's first-request work
                took.append((time.perf_counter() - start) * 1000)
    took.sort()
    return took[len(took) // 2], took[min(len(took) - 1, int(len(took) * 0.99))]


def guard_facts(backend: str) -> list[dict[str, object]]:
    """A guard on the backend's deployment with a pool that holds every prompt of the run (its
    1 MB exchange's prompt included, by its bytes): the guard's cost on requests it lets through."""
    from kvcanary.wire import api_base_key

    return [{"target": "shop", "api_bases": [api_base_key(backend)], "mode": "enforce",
             "kv_pool_tokens": 1_000_000, "chars_per_token": 4.2}]  # fmt: skip


def guard_cost(backend: str, size: int, n: int = 20_000) -> tuple[float, float]:
    """The admission guard's own time per request in this process (p50, p99 in microseconds) for a
    chat prompt of ``size`` characters that the pool holds."""
    import asyncio

    from kvcanary.tap.containment.guard import AdmissionGuard
    from kvcanary.tap.containment.watch import QuarantineWatch

    watch = QuarantineWatch(backend, "bench-token-0123456789", keys=SIGNING[0].public_keys, start=False)
    assert watch.poll_once() and watch.current.guards, "the backend's guards were not read"
    guard = AdmissionGuard(watch, count=lambda target, mode: None)
    group = [{"model_name": "shop", "litellm_params": {"api_base": f"{backend}/v1"}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT[:size]}]

    async def run() -> list[float]:
        took = []
        for _ in range(n):
            start = time.perf_counter()
            await guard.admit("shop", group, messages, None)
            took.append((time.perf_counter() - start) * 1e6)
        return took

    took = sorted(asyncio.run(run()))
    return took[n // 2], took[int(n * 0.99)]


def filter_cost(backend: str, n: int = 20_000) -> tuple[float, float]:
    """The quarantine filter's own time per request in this process (p50, p99 in microseconds): the
    set the backend serves, a group of three deployments of which none is quarantined."""
    from kvcanary.tap.containment.litellm_filter import QuarantineFilter
    from kvcanary.tap.containment.watch import QuarantineWatch

    watch = QuarantineWatch(backend, "bench-token-0123456789", keys=SIGNING[0].public_keys, start=False)
    assert watch.poll_once(), "the backend's quarantine set was not read"
    keep = QuarantineFilter(watch, count=lambda target, mode: None).keep
    group = [
        {"model_name": "shop", "litellm_params": {"api_base": f"http://10.8.0.{i}:8000/v1"}} for i in range(3)
    ]
    took = []
    for _ in range(n):
        start = time.perf_counter()
        keep("shop", group)
        took.append((time.perf_counter() - start) * 1e6)
    took.sort()
    return took[n // 2], took[int(n * 0.99)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    if not litellm_ready():
        sys.exit("no LiteLLM venv: run bash scripts/setup-litellm.sh")
    backend = serve()
    QUARANTINE_SET["guards"] = guard_facts(backend)
    key = next(iter(CALLERS))
    tap_env = {"KVCANARY_TAP_URL": backend, "KVCANARY_TAP_TOKEN": "bench-token-0123456789",
               "KVCANARY_TAP_KEY": "bench-fingerprint-key-0123456789"}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        SIGNING.append(make_keys(Path(tmp) / "keys"))
        noop = Path(tmp) / "noop"
        noop.mkdir()
        (noop / "noop_logger.py").write_text(NOOP)
        proxies = {
            "proxy": start_proxy(Path(tmp) / "plain", {"shop": backend}, None),
            "proxy+noop": start_proxy(noop, {"shop": backend}, tap_env, callback="noop_logger.noop"),
            "proxy+tap": start_proxy(Path(tmp) / "tap", {"shop": backend}, tap_env),
            "proxy+tap+q": start_proxy(
                Path(tmp) / "quarantine",
                {"shop": backend},
                {**tap_env, "KVCANARY_TAP_QUARANTINE": "1", **SIGNING[0].tap_env()},
            ),
        }
        try:
            print(f"{'exchange':>8} {'path':>10} {'p50 ms':>8} {'p99 ms':>8}")
            for label, size in SIZES.items():
                n = args.requests if size < 100_000 else max(20, args.requests // 10)
                rows = {"direct": timings(backend, key, size, n)}
                rows |= {name: timings(p.url, key, size, n) for name, p in proxies.items()}
                for name, (median, tail) in rows.items():
                    print(f"{label:>8} {name:>10} {median:8.2f} {tail:8.2f}")
                p50 = {name: row[0] for name, row in rows.items()}
                proxy, callback = p50["proxy"] - p50["direct"], p50["proxy+noop"] - p50["proxy"]
                tap = p50["proxy+tap"] - p50["proxy+noop"]
                p99 = {name: row[1] for name, row in rows.items()}
                fence = p50["proxy+tap+q"] - p50["proxy+tap"], p99["proxy+tap+q"] - p99["proxy+tap"]
                added = f"the proxy {proxy:.2f}, a callback {callback:.2f}, the tap {tap:.2f}, "
                added += f"the filter {fence[0]:.2f} (p99 {fence[1]:.2f})"
                print(f"{label:>8}  p50 added: {added}")
            median, tail = filter_cost(backend)
            print(f"the quarantine filter in process: p50 {median:.1f} us, p99 {tail:.1f} us per request")
            for label, size in SIZES.items():
                median, tail = guard_cost(backend, size * 3 // 4, 20_000 if size < 100_000 else 2_000)
                said = f"p50 {median:.1f} us, p99 {tail:.1f} us"
                print(f"the admission guard in process, {label} exchange: {said}")
        finally:
            for started in proxies.values():
                stop_process(started.proc)


if __name__ == "__main__":
    main()
