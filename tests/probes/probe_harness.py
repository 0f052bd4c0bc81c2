"""What probe tests share: worker flags, targets, a probe runner, and a scripted engine at the seam.

:class:`Reference` builds real :class:`OpenAIHttpTarget`s for a worker started by the ``reference``
fixture (``conftest.py``). :class:`FakeEngine` answers like the worker, served on a loopback socket
(:class:`~tests.support.loopback.Loopback`), for judgment logic that a real process would make slow or
impossible to provoke (a 429, a nonce that does not come back).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes import REGISTRY
from kvcanary.probes.base import ProbeContext, ProbeResult, Verdict
from kvcanary.probes.markers import MARKER_RE, MarkerBook
from tests.support.loopback import Handler, Loopback

TENANTS = ("alice", "bob")
KEYS = {
    "alice": "kvc-test-key-alice-0001",
    "bob": "kvc-test-key-bob-0002",
    "carol": "kvc-test-key-carol-0003",
}
MODEL = "kvcanary-reference"

# Small pools, as in the incident's shape: a context window (8192) far larger than the prefill pool.
SMALL = ("--page-size", "16", "--context-window", "8192")
AGGREGATED = ("--mode", "aggregated", "--kv-pool-tokens", "1024", *SMALL)
DISAGG = ("--mode", "disaggregated", "--prefill-pool-tokens", "1024", "--decode-pool-tokens", "4096", *SMALL)
REJECT = (*DISAGG, "--admission", "reject")
PLACEHOLDER = (*DISAGG, "--admission", "placeholder")
#: Workers tests may share, by mode: the clean ones, and the defective one for checks under capacity.
SHARED = {"aggregated": AGGREGATED, "disaggregated-reject": REJECT, "disaggregated-placeholder": PLACEHOLDER}
CLEAN = ("aggregated", "disaggregated-reject")


def target_config(
    url: str, tenants: tuple[str, ...] = TENANTS, *, engine: str = "reference", **options: Any
) -> TargetConfig:
    kinds = ["canary", "boundary"] + (["cross_tenant"] if len(tenants) > 1 else [])
    return TargetConfig(
        name="ref",
        base_url=url,
        engine=engine,
        model=MODEL,
        tenants=[{"name": t} for t in tenants],
        timeout_seconds=15,
        probes=kinds,
        options={"boundary": options} if options else {},
    )


@dataclass
class Reference:
    """A started reference worker (or an address where none listens)."""

    url: str

    def target(self, *tenants: str) -> OpenAIHttpTarget:
        """Return a target speaking to this worker as ``tenants`` (default alice and bob); close it."""
        names = tenants or TENANTS
        return OpenAIHttpTarget(target_config(self.url, names), {t: KEYS[t] for t in names})


async def run_probe(
    kind: str, target: OpenAIHttpTarget, book: MarkerBook | None = None, **options: Any
) -> ProbeResult:
    """Run the registered probe ``kind`` once against ``target``, as the runner would."""
    ctx = ProbeContext(target, book if book is not None else MarkerBook(), options)
    return await REGISTRY[kind]().run(ctx)


def probe_once(kind: str, target_factory: Callable[[], OpenAIHttpTarget], **options: Any) -> ProbeResult:
    """Run ``kind`` once in a fresh event loop with a target built inside it (clients bind to a loop)."""

    async def go() -> ProbeResult:
        async with target_factory() as target:
            return await run_probe(kind, target, **options)

    return asyncio.run(go())


def run_kind(
    kind: str, worker: Reference, *, timeout: float | None = None, **options: Any
) -> tuple[Verdict, str, dict[str, Any]]:
    """Run ``kind`` once as the runner does (``judge()`` included) against ``worker``, with ``options``."""
    update: dict[str, Any] = {"probes": ["canary", kind], "options": {kind: options}}
    if timeout is not None:
        update["timeout_seconds"] = timeout
    config = target_config(worker.url).model_copy(update=update)

    async def go() -> tuple[Verdict, str, dict[str, Any]]:
        async with OpenAIHttpTarget(config, {t: KEYS[t] for t in TENANTS}) as target:
            result, _ = await execute_probe(kind, target, MarkerBook(), config)
        return result.verdict, result.reason, result.evidence

    return asyncio.run(go())


# --- a scripted engine at the network seam ------------------------------------------------------------


@dataclass
class Call:
    """One completion request as the fake engine saw it."""

    path: str
    tenant: str
    body: dict[str, Any]

    @property
    def chat(self) -> bool:
        return self.path.endswith("/chat/completions")

    @property
    def prompt(self) -> str:
        if self.chat:
            return "\n".join(m["content"] for m in self.body["messages"])
        return str(self.body["prompt"])

    @property
    def markers(self) -> list[str]:
        return [m.group(0) for m in MARKER_RE.finditer(self.prompt)]


def answer(call: Call, text: str, prompt_tokens: int | None = None) -> httpx.Response:
    """Return a 200 in the shape the call asked for (stream or not, chat or not), with usage."""
    usage = {
        "prompt_tokens": len(call.prompt.encode()) if prompt_tokens is None else prompt_tokens,
        "completion_tokens": len(text.encode()),
    }
    if not call.body.get("stream"):
        choice = {"message": {"role": "assistant", "content": text}} if call.chat else {"text": text}
        return httpx.Response(200, json={"choices": [{**choice, "finish_reason": "stop"}], "usage": usage})
    piece = {"delta": {"content": text}} if call.chat else {"text": text}
    chunks = [{"choices": [{**piece, "finish_reason": "stop"}]}, {"choices": [], "usage": usage}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())


def error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "Error", "code": status}})


Answer = Callable[[Call], httpx.Response | Awaitable[httpx.Response]]
REFERENCE_INFO = {
    "context_length": 8192,
    "max_total_num_tokens": 1024,
    "max_req_input_len": 1023,
    "page_size": 16,
    "kv_pools": {"prefill": 1024, "decode": 4096},
}


@dataclass
class FakeEngine:
    """Answer like the reference worker (byte tokens, echo) unless ``reply`` says otherwise.

    ``info`` is served at /get_server_info (None: 404); ``tokenize`` turns /tokenize on or off and
    ``count`` is its tokenizer (bytes by default).
    Every completion call is kept in ``calls``; ``max_in_flight`` counts overlapping ones;
    ``info_reads`` counts the server-info lookups; each completion is held ``hold_seconds``.
    """

    reply: Answer | None = None
    info: dict[str, Any] | None = field(default_factory=lambda: dict(REFERENCE_INFO))
    tokenize: bool = True
    count: Callable[[str], int] = lambda text: len(text.encode())
    calls: list[Call] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    info_reads: int = 0
    #: Long enough for concurrent requests to overlap (a test of overlap on a loaded machine holds longer).
    hold_seconds: float = 0.01

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path in ("/get_server_info", "/server_info"):
            self.info_reads += 1
            return httpx.Response(200, json=self.info) if self.info else error(404, "Not Found")
        if path == "/tokenize" and self.tokenize:
            prompt = json.loads(request.content)["prompt"]
            return httpx.Response(200, json={"count": self.count(prompt), "tokens": []})
        if not path.endswith("completions"):
            return error(404, "Not Found")
        tenant = next(
            (t for t, k in KEYS.items() if request.headers.get("authorization") == f"Bearer {k}"), "?"
        )
        call = Call(path, tenant, json.loads(request.content))
        self.calls.append(call)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.hold_seconds)
            result = (self.reply or self.echo)(call)
            return await result if asyncio.iscoroutine(result) else result  # type: ignore[return-value]
        finally:
            self.in_flight -= 1

    @staticmethod
    def echo(call: Call) -> httpx.Response:
        return answer(call, call.prompt[: call.body["max_tokens"]])

    def target(
        self, tenants: tuple[str, ...] = TENANTS, *, engine: str = "reference", **options: Any
    ) -> OpenAIHttpTarget:
        served = Loopback(self)
        config = target_config(served.url, tenants, engine=engine, **options)
        return LoopbackTarget(config, {t: KEYS[t] for t in tenants}, served)


class LoopbackTarget(OpenAIHttpTarget):
    """A target whose engine a :class:`Loopback` serves; closing the target stops the server."""

    def __init__(self, config: TargetConfig, keys: dict[str, str | None], served: Loopback, **kw: Any):
        super().__init__(config, keys, **kw)
        self.served = served

    async def aclose(self) -> None:
        await super().aclose()
        self.served.close()


def loopback_target(
    config: TargetConfig, keys: dict[str, str | None], handler: Handler, **kw: Any
) -> LoopbackTarget:
    """Return a target for ``config`` whose engine is ``handler``, served on loopback: every URL of the
    config (base, node info and metrics) keeps its path and gets the loopback's address."""
    served = Loopback(handler)
    return LoopbackTarget(rehome(config, served.url), keys, served, **kw)


def rehome(config: TargetConfig, url: str) -> TargetConfig:
    """Return ``config`` with the address of every URL in it replaced by ``url``'s."""

    def moved(old: str | None) -> str | None:
        if old is None:
            return None
        parts = urlsplit(old)
        return url + parts.path

    nodes = [
        node.model_copy(update={"info_url": moved(node.info_url), "metrics_url": moved(node.metrics_url)})
        for node in config.nodes
    ]
    return config.model_copy(update={"base_url": moved(config.base_url), "nodes": nodes})
