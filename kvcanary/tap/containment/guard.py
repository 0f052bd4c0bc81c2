"""The admission guard in the gateway: a prompt that a deployment's KV pool surely
cannot hold is kept off that deployment before any upstream call, and refused when no deployment
of its model group can hold it. The incident's engine admitted such prompts and answered them from
stale pages; this is the check it lacked, made from what kvcanary measured (``monitor/containment/guards.py``
publishes each guarded target's smallest KV pool and calibration beside the quarantine set).

Only a sure count refuses, never a guess. For each deployment of the group that has a guard:

1. **Surely fits**: an upper bound of the prompt's tokens, its UTF-8 bytes (a byte-level token
   holds at least one byte) and ``TEMPLATE_TOKENS`` a message, is within the pool. Almost every
   request stops here, on ``len()`` of its parts (the bytes are counted only when four bytes a
   character could be over the pool).
2. **The deployment's own count**: otherwise its tokenizer counts the prompt (``POST /tokenize`` at
   the root of its ``api_base``, vLLM's and the reference worker's shape; the chat template
   applied where the request is a chat), at most ``TOKENIZE_TIMEOUT_SECONDS``, once per request and
   tokenizer. A count over the pool is sure.
3. **No count** (no tokenizer route, an error, a timeout): the calibration's bound, the characters
   over ``SURE_DENSITY_MARGIN`` times the densest characters per token the monitor measured (the
   traffic tokens check's margin), refuses only a prompt far beyond any text the monitor saw;
   without a calibration the prompt is admitted.

Under the ``observe`` policy nothing is kept off: what would have been is counted and logged
once per target. Standard library only: this runs inside the gateway's process.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcanary.tap.containment.deployments import DeploymentKeys, api_key_of
from kvcanary.tap.containment.document import GuardEntry
from kvcanary.tap.containment.watch import QuarantineWatch
from kvcanary.tap.gateway_metrics import gateway_counter
from kvcanary.tap.http import _OPENER
from kvcanary.tap.record import Refusal
from kvcanary.wire import MAX_TOKEN_BYTES, SURE_DENSITY_MARGIN

log = logging.getLogger("kvcanary.tap")

#: Tokens a chat template may add per message (role tags, separators), and once per prompt.
TEMPLATE_TOKENS = 16
PROMPT_TOKENS = 64
#: How long a deployment's tokenizer may take to count a prompt (only prompts near a pool ask).
TOKENIZE_TIMEOUT_SECONDS = 2.0
#: The most of a tokenizer's answer read (it lists every token: a few bytes each).
MAX_TOKENIZE_BYTES = 64 * 1024 * 1024
#: Targets whose observe-mode line was logged, before the memory starts over.
MAX_LOGGED = 1024


class AdmissionRefused(Exception):
    """No deployment of the model group can hold the prompt: refused before any upstream call.

    LiteLLM's proxy answers an error's ``status_code`` with its ``message``; the same prompt would
    be refused again, so its router does not retry (``num_retries``)."""

    status_code = 400
    num_retries = 0

    def __init__(self, model_group: str, tokens: int, refusals: list[tuple[GuardEntry, int, str]]):
        """``refusals``: each deployment kept off, as (its guard, the prompt's sure count of
        tokens, its api_base key)."""
        self.model_group = model_group
        self.tokens = tokens
        self.refusals = refusals
        pools = "; ".join(f"target {g.target!r}: {g.kv_pool_tokens} tokens" for g, _, _ in refusals)
        self.message = (
            f"model {model_group!r}: the prompt is at least {tokens} tokens, more than the KV pool "
            f"of every deployment that would take it ({pools}, measured by kvcanary); refused "
            "before any upstream call"
        )
        super().__init__(self.message)

    @property
    def kvcanary_refusal(self) -> tuple[str, Refusal]:
        """The deployment the tap's record names (the first kept off) and what refused it."""
        guard, tokens, api_base = self.refusals[0]
        return api_base, Refusal("admission", tokens=tokens, kv_pool_tokens=guard.kv_pool_tokens)


@dataclass(frozen=True)
class Prompt:
    """What the guard reads of a request: its text parts, for counting, and how to ask a
    tokenizer (a chat's messages as given, or a completion's prompt)."""

    parts: list[str]
    messages: list[Any] | None
    text: str | None

    @property
    def chars(self) -> int:
        return sum(map(len, self.parts))


class AdmissionGuard:
    """Keeps a prompt off the deployments whose pool surely cannot hold it (module doc)."""

    def __init__(
        self,
        watch: QuarantineWatch,
        count: Callable[[str, str], None] | None = None,
        tokenize: Callable[[str, dict[str, Any], str | None], int | None] | None = None,
    ):
        """``count(target, mode)``: called once per request a guard kept off a target (``enforce``)
        or would have (``observe``); default: the gateway's Prometheus counter, where it has one.
        ``tokenize(url, body, api_key)``: a count, or None; default: an HTTP call."""
        self.watch = watch
        self._count = count or gateway_counter(
            "kvcanary_tap_admission_refusals",
            "Requests kvcanary's admission guard kept off a target's deployments because its KV pool "
            "surely cannot hold the prompt (mode enforce), or would have (mode observe).",
            ("target", "mode"),
        )
        self._tokenize = tokenize or tokenize_over_http
        #: Requests per (target, mode), as ``count`` was told.
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._logged: set[str] = set()
        self._doubted: set[str] = set()  # deployments whose tokenizer's impossible count was logged
        self._key_of = DeploymentKeys()

    async def admit(
        self, model_group: str, deployments: list[Any], messages: Any, request: dict[str, Any] | None
    ) -> list[Any]:
        """Return ``deployments`` less those whose pool surely cannot hold the prompt (the same
        list when none has a guard); raise :class:`AdmissionRefused` when that leaves none."""
        guards = self.watch.snapshot().guards
        if not guards or not deployments:
            return deployments
        guarded = [(d, guards.get(self._key_of(d))) for d in deployments]
        if all(g is None for _, g in guarded):
            return deployments
        prompt = prompt_of(messages, request)
        if prompt is None:
            return deployments
        kept: list[Any] = []
        refused: list[tuple[GuardEntry, int, str]] = []
        counted: dict[str, int | None] = {}  # by tokenize URL: one count per tokenizer a request
        for deployment, guard in guarded:
            tokens = None if guard is None else await self._sure_over(prompt, deployment, guard, counted)
            if guard is None or tokens is None:
                kept.append(deployment)
            elif self._refuse(model_group, guard, tokens):
                refused.append((guard, tokens, self._key_of(deployment)))
            else:
                kept.append(deployment)
        if refused and not kept:
            raise AdmissionRefused(model_group, min(t for _, t, _ in refused), refused)
        return kept

    async def _sure_over(
        self, prompt: Prompt, deployment: Any, guard: GuardEntry, counted: dict[str, int | None]
    ) -> int | None:
        """Return a sure count of the prompt's tokens over ``guard``'s pool, or None: it fits, or
        nothing sure says it does not."""
        pool, chars = guard.kv_pool_tokens, prompt.chars
        allowance = PROMPT_TOKENS + TEMPLATE_TOKENS * max(1, len(prompt.parts))
        if 4 * chars + allowance <= pool or _utf8_bytes(prompt) + allowance <= pool:
            return None
        url = self._key_of(deployment) + "/tokenize"
        if url not in counted:
            body, api_key = _tokenize_body(prompt), api_key_of(deployment)
            counted[url] = await asyncio.to_thread(self._tokenize, url, body, api_key)
        tokens = counted[url]
        if tokens is not None and tokens < (least := least_tokens(prompt, guard.chars_per_token)):
            self._doubt(url, tokens, least)
            tokens = None
        if tokens is None and guard.chars_per_token:
            tokens = int(chars / (guard.chars_per_token * SURE_DENSITY_MARGIN))
        return tokens if tokens is not None and tokens > pool else None

    def _doubt(self, url: str, tokens: int, least: int) -> None:
        """Log, once per tokenizer, a count its prompt rules out."""
        if url in self._doubted:
            return
        if len(self._doubted) >= MAX_LOGGED:
            self._doubted.clear()
        self._doubted.add(url)
        log.warning(
            "kvcanary tap: the tokenizer at %s counted %d tokens for a prompt of at least %d tokens: no "
            "tokenizer makes that count, so it is not taken as one (the calibration's bound applies)",
            url, tokens, least,
        )  # fmt: skip

    def _refuse(self, model_group: str, guard: GuardEntry, tokens: int) -> bool:
        """Count a prompt over ``guard``'s pool; return whether it is kept off (enforced)."""
        mode = "enforce" if guard.enforced else "observe"
        self.counts[guard.target, mode] += 1
        self._count(guard.target, mode)
        if not guard.enforced and guard.target not in self._logged:
            if len(self._logged) >= MAX_LOGGED:
                self._logged.clear()
            self._logged.add(guard.target)
            log.warning(
                "kvcanary tap: observe mode: a prompt of at least %d tokens to model %r was routed to "
                "target %r, whose smallest KV pool is %d tokens (enforced, it would have been kept off)",
                tokens, model_group, guard.target, guard.kv_pool_tokens,
            )  # fmt: skip
        return guard.enforced


def prompt_of(messages: Any, request: dict[str, Any] | None) -> Prompt | None:
    """Return the request's prompt: a chat's messages, else a completion's ``prompt`` string; None
    where it is neither (nothing to count: admitted)."""
    if isinstance(messages, list) and messages:
        parts: list[str] = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):  # parts: [{"type": "text", "text": ...}, ...]
                parts += [
                    p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
                ]
        return Prompt(parts, messages, None)
    text = (request or {}).get("prompt")
    if isinstance(text, str):
        return Prompt([text], None, text)
    return None


def least_tokens(prompt: Prompt, chars_per_token: float | None) -> int:
    """Return the fewest tokens any count of ``prompt`` may be: its UTF-8 bytes over
    ``MAX_TOKEN_BYTES``, rounded up (at least 1 for a prompt of any text), and, where the monitor
    measured the target's densest text, its characters over ``SURE_DENSITY_MARGIN`` times that."""
    least = -(-_utf8_bytes(prompt) // MAX_TOKEN_BYTES)
    if chars_per_token:
        least = max(least, int(prompt.chars / (chars_per_token * SURE_DENSITY_MARGIN)))
    return least


def _utf8_bytes(prompt: Prompt) -> int:
    return sum(len(part.encode("utf-8", "surrogatepass")) for part in prompt.parts)


def _tokenize_body(prompt: Prompt) -> dict[str, Any]:
    """vLLM's ``/tokenize`` body: the chat's messages (the engine applies its template) or the
    prompt. No ``model``: a gateway's name for it need not be the engine's (the monitor's own
    counts omit it too)."""
    if prompt.messages is not None:
        return {"messages": prompt.messages}
    return {"prompt": prompt.text}


def tokenize_over_http(url: str, body: dict[str, Any], api_key: str | None) -> int | None:
    """Return the count a tokenizer answers at ``url``, or None for any failure (a guard that
    cannot count admits)."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with _OPENER.open(request, timeout=TOKENIZE_TIMEOUT_SECONDS) as answer:
            answered = json.loads(answer.read(MAX_TOKENIZE_BYTES))
    except urllib.error.HTTPError as exc:
        exc.close()
        return None
    except (OSError, ValueError):
        return None
    if not isinstance(answered, dict):
        return None
    count = answered.get("count")
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        return count
    tokens = answered.get("tokens")
    return len(tokens) if isinstance(tokens, list) else None
