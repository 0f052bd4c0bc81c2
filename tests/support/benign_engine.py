"""A benign engine: everything a correct engine may do that is no leak, for probes that must stay quiet.

Probes page people; a verdict that a correct engine also earns is noise that teaches them to switch
the monitor off. This engine is correct where isolation is concerned (no page, cache or answer
crosses requests; over-window prompts refused; usage counts the prompt; hang-ups counted as aborts)
and does, at random, what real engines do that a careless judge mistakes for a fault:

- **long answers drift**: at temperature 0, from a point between :data:`DRIFT_FROM` and
  :data:`DRIFT_TO` tokens into an answer, the rest is another run's (batch nondeterminism: greedy
  answers of real engines diverge after about a hundred tokens, ``docs/detection-research.md``);
  a sampled answer (temperature > 0) drifts anywhere from its first tokens;
- **harmless wrapping**: a prefix (``Sure:``, ``Here it is: "``) before the answer and a quote or
  full stop after it, the same for the same conversation at temperature 0 (a property of the
  prompt, as a model's habits are), any at random when sampled;
- **failures**: one completion in :data:`FAIL_ONE_IN` answers 503, as an overloaded engine does.

Per-request parameters are honoured as a correct engine honours them: the budget, ``stop`` (the
answer ends before the first stop string and never holds one), vLLM's ``allowed_token_ids`` (one
character one token: the answer holds only the characters allowed) and ``thinking_token_budget``
(:data:`REASONING_END` written once that many tokens were, as vLLM forces its reasoning end).

Two answering styles, since probes meet both: ``echo`` (a copy model: the conversation from its
first token, like the reference worker and the tiny random-weight models of the engine tests) and
``instruct`` (answers the code it was asked for, the latest one the conversation holds, and "OK"
when told to say OK). One character is one token; the wire is the reference worker's (SGLang-shaped
``/server_info``, ``/tokenize``, ``/metrics`` with the worker contract's counters), served by
aiohttp on a loopback port in a thread of its own.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.support.loopback import ServedApp

DRIFT_FROM, DRIFT_TO = 110, 170
FAIL_ONE_IN = 25
#: An instruction model's wrapping; a copy model's is a byte or two of template (its answer is the
#: prompt itself, and the canary's budget is the prompt's length).
PREFIXES = {"instruct": ("", "Sure: ", 'Here it is: "', "`", "Answer: "), "echo": ("", " ", "\n", "`")}
SUFFIXES = ("", '"', "`", ".")
#: Tokens written between two looks at the client: a hang-up is noticed within one such step. At
#: 8,000 tokens a second per request (faster than any real engine), an answer of the hang-up kind's
#: 512 tokens is still being written when its client gives up after 20 ms, as on every real engine:
#: at 32,000 (a step of 1 ms) one such answer in 150 runs finished just before its client left,
#: uncounted as an abort, under the full suite's load.
STEP_TOKENS = 32
STEP_SECONDS = 0.004
MARKER = re.compile(r"KVC-[0-9a-fA-F]{8}-[0-9a-fA-F]{32}")
CONTEXT, POOL = 4096, 8192
#: The reasoning-end string the engine forces where a request's thinking budget runs out.
REASONING_END = "</think>"


@dataclass
class Counters:
    """What the engine counts, exported in the reference worker's metric names."""

    requests: int = 0
    aborted: int = 0
    rejected: int = 0
    codes: dict[int, int] = field(default_factory=dict)


def _drift_letters(rng: random.Random, n: int) -> str:
    """Return ``n`` characters of another run's continuation: lower-case words, never a marker."""
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < n:
        out.append("".join(rng.choice("etaoinshrdlu") for _ in range(rng.randint(2, 9))))
    return " ".join(out)[:n]


class BenignEngine:
    """The engine's answers (see the module doc); ``style`` is ``echo`` or ``instruct``."""

    def __init__(self, style: str = "echo", seed: int | None = None) -> None:
        if style not in ("echo", "instruct"):
            raise ValueError(f"style must be echo or instruct, not {style!r}")
        self.style = style
        self.rng = random.Random(seed)
        self.counters = Counters()

    # --- what a request asks -------------------------------------------------------------------

    @staticmethod
    def conversation(body: dict[str, Any]) -> list[tuple[str, str]]:
        """Return (role, text) of everything the request sends, in order."""
        if "messages" in body:
            return [(str(m.get("role", "user")), str(m.get("content") or "")) for m in body["messages"]]
        return [("user", str(body.get("prompt", "")))]

    @staticmethod
    def rendered(turns: list[tuple[str, str]]) -> str:
        return "\n".join(text for _, text in turns)

    def ideal(self, turns: list[tuple[str, str]]) -> str:
        """Return the answer a deterministic engine of this style would write, before wrapping."""
        if self.style == "echo":
            return self.rendered(turns)
        last = turns[-1][1] if turns else ""
        if "Say OK" in last:
            return "OK"
        codes = [m.group(0) for _, text in turns for m in MARKER.finditer(text)]
        if not codes:
            return "I have no code to repeat."
        if "until stopped" in last:
            return "\n".join([codes[-1]] * 64)
        return codes[-1]

    def answer(self, body: dict[str, Any]) -> str:
        """Return one choice's text: wrapped, drifted, cut to the request's budget."""
        rng, turns = self.rng, self.conversation(body)
        sampled = float(body.get("temperature") or 0.0) > 0
        habit = rng if sampled else random.Random(self.rendered(turns))
        text = habit.choice(PREFIXES[self.style]) + self.ideal(turns) + habit.choice(SUFFIXES)
        drift_at = rng.randint(0, 60) if sampled else rng.randint(DRIFT_FROM, DRIFT_TO)
        if len(text) > drift_at:
            text = text[:drift_at] + _drift_letters(rng, len(text) - drift_at)
        thinking = body.get("thinking_token_budget")
        if isinstance(thinking, int) and len(text) > thinking:
            text = text[:thinking] + REASONING_END + text[thinking:]
        allowed = body.get("allowed_token_ids")
        if allowed:
            text = "".join(c for c in text if ord(c) in set(allowed))
        budget = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        text = text[: max(1, int(budget))]
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        found = [at for stop in stops if (at := text.find(stop)) >= 0]
        return text[: min(found)] if found else text

    # --- HTTP ------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/get_server_info", self._server_info)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _server_info(self, _: web.Request) -> web.Response:
        return web.json_response({
            "context_length": CONTEXT, "max_total_num_tokens": POOL, "max_req_input_len": CONTEXT - 1,
            "page_size": 16, "max_running_requests": 16, "disaggregation_mode": "null",
            "version": "kvcanary-reference 0.1.0", "served_model_name": "benign", "status": "ready",
        })  # fmt: skip

    async def _models(self, _: web.Request) -> web.Response:
        model = {"id": "benign", "object": "model", "max_model_len": CONTEXT, "owned_by": "benign"}
        return web.json_response({"object": "list", "data": [model]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = body.get("prompt") if "prompt" in body else body.get("content", "")
        if "messages" in body:
            text = self.rendered(self.conversation(body))
        return web.json_response({"count": len(str(text).encode())})

    async def _metrics(self, _: web.Request) -> web.Response:
        c = self.counters
        lines = [
            "# TYPE kvcanary_requests_aborted_total counter",
            f"kvcanary_requests_aborted_total {c.aborted}",
            "# TYPE kvcanary_placeholder_substitutions_total counter",
            "kvcanary_placeholder_substitutions_total 0",
            "# TYPE kvcanary_kv_ownership_violations_total counter",
            "kvcanary_kv_ownership_violations_total 0",
            "# TYPE kvcanary_admission_rejections_total counter",
            f'kvcanary_admission_rejections_total{{reason="context_window"}} {c.rejected}',
            'kvcanary_admission_rejections_total{reason="kv_capacity"} 0',
            "# TYPE kvcanary_kv_pool_tokens gauge",
            f'kvcanary_kv_pool_tokens{{pool="unified"}} {POOL}',
            "# TYPE kvcanary_context_window_tokens gauge",
            f"kvcanary_context_window_tokens {CONTEXT}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    def _error(self, status: int, message: str, kind: str) -> web.Response:
        self.counters.codes[status] = self.counters.codes.get(status, 0) + 1
        return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.counters.requests += 1
        if self.rng.randrange(FAIL_ONE_IN) == 0:
            return self._error(503, "The engine is overloaded; try again.", "ServiceUnavailable")
        prompt_tokens = len(self.rendered(self.conversation(body)).encode())
        if prompt_tokens >= CONTEXT:
            self.counters.rejected += 1
            message = (
                f"The input ({prompt_tokens} tokens) is longer than the model's context length "
                f"({CONTEXT} tokens)."
            )
            return self._error(400, message, "BadRequestError")
        texts = [self.answer(body) for _ in range(int(body.get("n") or 1))]
        usage = {
            "prompt_tokens": prompt_tokens, "completion_tokens": sum(len(t) for t in texts),
            "total_tokens": prompt_tokens + sum(len(t) for t in texts),
            "prompt_tokens_details": {"cached_tokens": 0},
        }  # fmt: skip
        chat = "messages" in body
        if body.get("stream"):
            return await self._stream(request, texts[0], usage, chat)
        if not await self._generate(request, max(len(t) for t in texts)):
            return web.Response(status=499)
        choices = [
            {"index": i, **({"message": {"role": "assistant", "content": t}} if chat else {"text": t}),
             "finish_reason": "stop"}
            for i, t in enumerate(texts)
        ]  # fmt: skip
        return web.json_response({"id": f"benign-{time.monotonic_ns()}", "choices": choices, "usage": usage})

    async def _generate(self, request: web.Request, tokens: int) -> bool:
        """Spend the time writing ``tokens`` takes; return False (and count an abort) if the client left."""
        for _ in range(0, tokens, STEP_TOKENS):
            await asyncio.sleep(STEP_SECONDS)
            if request.transport is None or request.transport.is_closing():
                self.counters.aborted += 1
                return False
        return True

    async def _stream(
        self, request: web.Request, text: str, usage: dict[str, Any], chat: bool
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        try:
            await response.prepare(request)
            for start in range(0, len(text), STEP_TOKENS):
                piece = text[start : start + STEP_TOKENS]
                delta = {"delta": {"content": piece}} if chat else {"text": piece}
                event = {"choices": [{"index": 0, **delta, "finish_reason": None}]}
                await response.write(f"data: {json.dumps(event)}\n\n".encode())
                if not await self._generate(request, STEP_TOKENS):
                    return response
            end = {
                "choices": [
                    {"index": 0, **({"delta": {}} if chat else {"text": ""}), "finish_reason": "stop"}
                ]
            }
            await response.write(f"data: {json.dumps(end)}\n\n".encode())
            await response.write(
                f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()
            )
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.counters.aborted += 1
            raise
        return response


class BenignServer(ServedApp):
    """A :class:`BenignEngine` served at :attr:`url` (127.0.0.1, a free port) until :meth:`close`."""

    def __init__(self, style: str = "echo", seed: int | None = None) -> None:
        self.engine = BenignEngine(style, seed)
        super().__init__(self.engine.app())
