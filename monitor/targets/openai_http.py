"""The one HTTP client for every serving engine: OpenAI-compatible completions, capacity, tokenizing.

:class:`OpenAIHttpTarget` implements :class:`probes.target.TargetClient` for SGLang, vLLM, llama.cpp,
hosted OpenAI-compatible APIs and the reference worker. Its contract:

- It never raises on network or protocol trouble. ``complete`` returns a :class:`Completion` whose
  ``error_kind`` says what went wrong: ``connect`` (no connection; ``status`` None), ``timeout``
  (``config.timeout_seconds`` passed; ``status`` None unless headers had arrived), ``protocol`` (a
  body or stream that is not what the API promises), ``stream`` (the engine reported an error inside
  a 200 stream) or ``http`` (a non-2xx answer). Lookups return None fields instead.
- A request the server closed before a byte of answer is sent once more (a pooled connection the
  server let go of as it went out); one the server began to answer is never sent again.
- A non-2xx answer keeps its raw body, bounded to :data:`ERROR_BODY_BYTES`, in ``text``: an error
  body is output a tenant sees, so probes scan it for foreign markers like any other output.
- Every request it makes goes through :meth:`OpenAIHttpTarget.request`, which alone sets
  ``Authorization``, as :class:`~monitor.config.credentials.Credentials` decides for the URL (a
  tenant's key at the base URL's origin, the worker credential or the tenant's key elsewhere in the
  target's credential scope, nothing outside it), and never follows a redirect. No key appears in
  what it returns: every string passes through :meth:`OpenAIHttpTarget._scrub` first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Coroutine, Mapping
from typing import Any

import aiohttp
from yarl import URL

from kvcanary.monitor.config.credentials import Credentials
from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.targets.calibration import TokenCalibration
from kvcanary.monitor.targets.capacity import apply_overrides, read_capacity
from kvcanary.monitor.targets.http import CONNECT_ERRORS, UNHEARD_ERRORS, HttpClient, chunks
from kvcanary.monitor.targets.openai_format import (
    DEFAULT_LIMITS,
    ERROR_BODY_BYTES,
    Limits,
    ResponseTooLarge,
    StreamState,
    parse_body,
    read_bounded,
    read_limited,
    request_body,
    sse_lines,
    take_error,
)
from kvcanary.monitor.targets.paths import PathTarget, Send
from kvcanary.monitor.targets.scrape import parse_samples
from kvcanary.probes.target import (
    Completion,
    CompletionRequest,
    Fetched,
    Node,
    Scraped,
    ServerCapacity,
    ServingPath,
    TargetClient,
)

__all__ = ["ERROR_BODY_BYTES", "OpenAIHttpTarget"]

# Keys shorter than this are not scrubbed: replacing "a" everywhere would destroy the evidence, and a
# short hex key would cut markers apart (4 hex digits turn up in one marker in ~2,000; 8 in ~10^8).
_MIN_SCRUB_LEN = 8


#: What every JSON request carries besides its credential (shared: never changed).
_JSON = {"Content-Type": "application/json"}
_NO_HEADERS: dict[str, str] = {}

#: Engines that take SGLang's ``rid`` (a client request id) in the body.
RID_ENGINES = frozenset({"sglang", "reference"})


class HungUp(Exception):
    """The probe hung up on purpose (``CompletionRequest.hang_up_after_*``): a client that went away."""


class OpenAIHttpTarget:
    """A serving endpoint reached over HTTP; call :meth:`aclose`.

    ``api_keys`` maps each tenant name to its key, or None for an engine without authentication;
    ``worker_key`` is the target's worker credential (``worker_api_key_env``), or None. Where each
    goes is the target's credential scope's to say (:meth:`request`). ``client`` is the HTTP client
    shared with other targets (closing the target does not close it); without one the target
    makes its own.
    """

    def __init__(
        self,
        config: TargetConfig,
        api_keys: dict[str, str | None],
        limits: Limits = DEFAULT_LIMITS,
        client: HttpClient | None = None,
        worker_key: str | None = None,
    ):
        self.name = config.name
        self.tenants = [t.name for t in config.tenants]
        self.engine: str = config.engine
        self.nodes = config.node_list()
        self._config = config
        self._credentials = Credentials(config.credential_scope(), api_keys, worker_key)
        secrets = {k for k in self._credentials.secrets if len(k) >= _MIN_SCRUB_LEN}
        # Longest first, so a key that contains another is replaced whole.
        self._secrets = sorted(secrets, key=len, reverse=True)
        self._timeout = config.timeout_seconds
        self._limits = limits
        # Paths below start at /v1; a base URL written with its /v1 would double it.
        self._base = config.base_url.removesuffix("/v1")
        self._own_client = client is None
        self._client = client or HttpClient(max_connections=16)
        # Parsed once: a URL string is parsed again on every request.
        self._urls: dict[str, URL] = {}
        # The last capacity reading and when it was taken (monotonic), for callers that allow reuse.
        self._capacity: tuple[float, ServerCapacity] | None = None
        #: Characters per token of this target's tokenizer, from what it counted of the probes' texts.
        self.calibration = TokenCalibration()

    async def aclose(self) -> None:
        if self._own_client:
            await self._client.aclose()

    async def __aenter__(self) -> OpenAIHttpTarget:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- completions ----------------------------------------------------------------------------------

    async def complete(
        self, tenant: str, request: CompletionRequest, *, send: Send | None = None
    ) -> Completion:
        """Send one completion as ``tenant`` and return what came back; never raise (see module doc).

        ``send`` delivers the request's body and reads the answer into the state where the target's
        base URL would not (``monitor/targets/paths.py``: down one prefill x decode pair); by default
        :meth:`exchange` to the base URL.
        """
        path, body = request_body(request, self._config.model, takes_rid=self.engine in RID_ENGINES)
        state = StreamState(chat=request.chat, started=time.monotonic())

        def deliver(state: StreamState) -> Coroutine[Any, Any, None]:
            if send is None:
                return self.exchange(tenant, self._url(path), body, request, state)
            return send(tenant, path, body, request, state)

        try:
            async with asyncio.timeout(self._timeout):
                try:
                    await self._hang_up_in_time(request, deliver(state))
                except UNHEARD_ERRORS as exc:
                    if isinstance(exc, CONNECT_ERRORS) or state.status is not None:
                        raise
                    # Closed before a byte of answer: a pooled connection the server let go of as
                    # the request went out (a loaded host's loop can see an idle spell late). The
                    # engine never answered it, so it is sent once more (that connection is not pooled again).
                    state = StreamState(chat=request.chat, started=time.monotonic())
                    await self._hang_up_in_time(request, deliver(state))
        except HungUp as hung_up:
            state.fail("hung_up", str(hung_up))
        except TimeoutError:
            state.fail("timeout", f"no complete answer within {self._timeout:g}s")
        except CONNECT_ERRORS as exc:
            state.fail("connect", f"cannot connect to {self._config.base_url}: {exc}")
        except ResponseTooLarge as exc:
            state.fail("too_large", f"{exc}: read no further")
        except aiohttp.ClientError as exc:
            state.fail("protocol", f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # A monitor must survive any odd answer; say what it was.
            state.fail("protocol", f"{type(exc).__name__}: {exc}")
        completion = state.to_completion(time.monotonic())
        completion.text = self._scrub(completion.text)
        completion.error = self._scrub(completion.error) if completion.error else None
        return completion

    @staticmethod
    async def _hang_up_in_time(request: CompletionRequest, exchange: Coroutine[Any, Any, None]) -> None:
        """Await ``exchange``; with ``hang_up_after_seconds``, give up on it then (closing the socket)."""
        if request.hang_up_after_seconds is None:
            return await exchange
        try:
            async with asyncio.timeout(request.hang_up_after_seconds) as deadline:
                await exchange
        except TimeoutError:
            if not deadline.expired():  # aiohttp's own timeout: a failure, not the probe's hang-up
                raise
            raise HungUp(f"hung up after {request.hang_up_after_seconds:g}s, as the probe asked") from None

    @contextlib.asynccontextmanager
    async def request(
        self,
        method: str,
        url: URL,
        *,
        tenant: str | None,
        headers: Mapping[str, str] = _NO_HEADERS,
        data: bytes | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """Send one request of this target's to ``url`` as ``tenant`` (None: a lookup) and yield the
        response; raise what aiohttp raises. The one way this target reaches the network: the
        ``Authorization`` header is the credentials' word for ``url`` alone (``headers`` carry no
        credential of their own), and a redirect is answered, never followed (it would carry the
        request's headers to wherever it points)."""
        session = await self._client.session()
        sent = {name: value for name, value in headers.items() if name.lower() != "authorization"}
        sent.update(self._credentials.authorization(url, tenant))
        async with session.request(method, url, headers=sent, data=data, allow_redirects=False) as response:
            yield response

    @staticmethod
    def headers_for(request: CompletionRequest) -> dict[str, str]:
        """The headers a completion carries besides its credential: its type, the request's own id,
        and those the probe set (a cache salt a gateway would set); ``request()`` drops any
        ``Authorization`` among them."""
        headers = {**request.headers, **_JSON}
        if request.request_id is not None:
            headers["X-Request-Id"] = request.request_id
        return headers

    async def exchange(
        self, tenant: str, url: URL, body: dict[str, Any], request: CompletionRequest, state: StreamState
    ) -> None:
        """POST ``body`` to ``url`` as ``tenant`` and read the answer, streamed or not, into ``state``."""
        async with self.request(
            "POST", url, tenant=tenant, headers=self.headers_for(request), data=json.dumps(body).encode()
        ) as response:
            state.status = response.status
            if not 200 <= response.status < 300:
                take_error(state, response.status, await read_bounded(chunks(response), ERROR_BODY_BYTES))
                return
            content_type = response.headers.get("content-type", "")
            after = request.hang_up_after_chunks
            if after == 0:
                response.close()
                raise HungUp("hung up once the headers came, before the body, as the probe asked")
            if request.stream and "text/event-stream" in content_type:
                lines = sse_lines(chunks(response), self._limits)
                async for line in lines:
                    if not state.feed_sse_line(line, time.monotonic()):
                        break
                    if after is not None and state.chunks >= after:
                        response.close()  # the connection is dropped, not kept for the pool
                        raise HungUp(f"hung up after {state.chunks} chunks, as the probe asked")
                state.finish_stream()
                # Read what follows [DONE] (a blank line): a response closed unread cannot go
                # back to the pool, and every run would pay a new connection. After a break, keep it.
                async for rest in lines:
                    state.keep_tail(rest)
                return
            # Some servers ignore ``stream``; a JSON body is as good an answer.
            raw, complete = await read_limited(
                chunks(response), self._limits.response_bytes, response.content_length
            )
            if not complete:
                raise ResponseTooLarge(f"the answer is over {self._limits.response_bytes} bytes")
            parse_body(raw.encode(), state, time.monotonic())

    def _url(self, path: str) -> URL:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self._base + path)
        return url

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, "<api-key>")
        return text

    # --- lookups --------------------------------------------------------------------------------------

    async def fetch(self, url: str) -> Fetched:
        """GET an absolute ``url`` (a node's metrics or info) and return its body, bounded; never raise.
        It carries a credential only where the target's credential scope lets it (:meth:`request`)."""
        limit = self._limits.lookup_bytes
        try:
            async with asyncio.timeout(self._timeout):
                async with self.request("GET", URL(url), tenant=None) as response:
                    status = response.status
                    if not 200 <= response.status < 300:
                        return Fetched(None, f"HTTP {status} from {url}", status)
                    body, complete = await read_limited(chunks(response), limit, response.content_length)
        except TimeoutError:
            return Fetched(None, f"no answer from {url} within {self._timeout:g}s")
        except (aiohttp.ClientError, ValueError) as exc:
            return Fetched(None, self._scrub(f"cannot read {url}: {type(exc).__name__}: {exc}"))
        if not complete:
            return Fetched(None, f"{url} sent more than {limit} bytes", status)
        return Fetched(body, None, status)

    async def scrape(self, url: str) -> Scraped:
        """GET a node's Prometheus page and parse it (:func:`parse_samples`); never raise."""
        fetched = await self.fetch(url)
        if fetched.text is None:
            return Scraped(None, "metrics_unreachable", fetched.error or f"nothing read from {url}")
        try:
            return Scraped(parse_samples(fetched.text))
        except ValueError as exc:
            return Scraped(None, "metrics_unparseable", f"{url} is not Prometheus text: {exc}")

    async def node_capacity(self, node: Node) -> ServerCapacity:
        """Return what one node publishes about its KV pools and context window (at its ``info_url``),
        without overrides; unknown fields are None and ``source`` says where each lookup went."""
        lookups = NodeLookups(self, node.info_url)
        try:
            found = await read_capacity(lookups, self.engine)
        except Exception:  # A lookup never breaks a probe: unknown is an answer.
            found = ServerCapacity(source="lookup failed")
        if lookups.failures and not (found.context_window or found.kv_pool_tokens):
            found.source = f"{found.source} ({'; '.join(lookups.failures[:3])})"
        found.unanswered = lookups.transient or found.source.startswith("lookup failed")
        return found

    async def capacity(self, max_age: float = 0.0) -> ServerCapacity:
        """Return what the node says about its KV pool and context window; unknown fields are None.

        ``options["boundary"]`` in the target's config overrides any field (``context_window``,
        ``kv_pool_tokens``, ``max_req_input_len``, ``page_size``): an operator can state a pool the
        engine does not publish. A reading younger than ``max_age`` seconds is returned again
        without a lookup (a probe that only sizes its prompts by it; audits read afresh). A reading
        made while a lookup went unanswered (no connection, a timeout, a 5xx) is never reused.
        """
        now = time.monotonic()
        if self._capacity is not None and now - self._capacity[0] < max_age:
            return self._capacity[1]
        lookups = NodeLookups(self, self._config.base_url)
        try:
            found = await read_capacity(lookups, self.engine)
        except Exception:  # A lookup never breaks a probe: unknown is an answer.
            found = ServerCapacity(source="lookup failed")
        found = apply_overrides(found, self.overrides)
        found.unanswered = lookups.transient or found.source.startswith("lookup failed")
        # A reading made while a lookup timed out (the pool unread) would size plants wrong for long.
        self._capacity = None if found.unanswered else (now, found)
        return found

    @property
    def overrides(self) -> dict[str, Any]:
        """What the operator states of the target's capacity (``options.boundary``): see :meth:`capacity`."""
        return dict(self._config.options.get("boundary", {}))

    def via(self, path: ServingPath) -> TargetClient:
        """Return this target as one prefill x decode pair serves it (``monitor/targets/paths.py``)."""
        return PathTarget(self, path)

    def forget_capacity(self) -> None:
        """Drop the kept capacity reading: the node's configuration changed (a capacity audit saw it)."""
        self._capacity = None

    async def count_tokens(self, text: str, *, at: Node | None = None) -> int | None:
        """Return how many tokens the engine's own tokenizer makes of ``text``; None when it cannot say.
        ``at`` asks that node's own API rather than the base URL (a gateway may not pass /tokenize on).

        llama.cpp's server takes ``{"content"}`` and answers ``{"tokens": [...]}``; llama-cpp-python's
        server has ``/extras/tokenize/count`` (``{"input"}`` → ``{"count"}``); vLLM, SGLang and the
        reference worker take ``{"prompt"}`` and answer ``{"count", "tokens", ...}``. No ``model`` is
        sent: vLLM refuses a name it does not serve, and every engine defaults to its one model.
        """
        if self.engine == "openai":
            return None
        base = self._base if at is None else at.info_url.rstrip("/").removesuffix("/v1")
        if self.engine == "llamacpp":
            count = await self._tokenize(base + "/tokenize", {"content": text})
            if count is None:
                count = await self._tokenize(base + "/extras/tokenize/count", {"input": text})
            self.calibration.note(len(text), count)
            return count
        count = await self._tokenize(base + "/tokenize", {"prompt": text})
        if count is None and self.engine == "sglang":
            count = await self._tokenize(base + "/v1/tokenize", {"prompt": text})
        self.calibration.note(len(text), count)
        return count

    async def _tokenize(self, url: str, body: dict[str, Any]) -> int | None:
        try:
            async with asyncio.timeout(self._timeout):
                async with self.request(
                    "POST", URL(url), tenant=None, headers=_JSON, data=json.dumps(body).encode()
                ) as response:
                    raw, complete = await read_limited(
                        chunks(response), self._limits.lookup_bytes, response.content_length
                    )
                    ok = 200 <= response.status < 300
            data = json.loads(raw) if ok and complete else None
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None
        if not isinstance(data, dict):
            return None
        count = data.get("count")
        if isinstance(count, int) and not isinstance(count, bool):
            return count
        tokens = data.get("tokens")
        return len(tokens) if isinstance(tokens, list) else None


class NodeLookups:
    """The lookups :func:`read_capacity` makes, against one node's own address; failures kept in words."""

    def __init__(self, target: OpenAIHttpTarget, base: str):
        self._target = target
        self._base = base.rstrip("/")
        self.failures: list[str] = []
        #: Whether a lookup failed for a passing reason (no answer, a timeout, a 5xx), not because the
        #: engine has no such endpoint: a reading made with one is not worth keeping.
        self.transient = False

    async def get_text(self, path: str) -> str | None:
        fetched = await self._target.fetch(self._base + path)
        if fetched.text is None:
            self.failures.append(fetched.error or path)
            self.transient = self.transient or fetched.status is None or fetched.status >= 500
        return fetched.text

    async def get_json(self, path: str) -> Any | None:
        text = await self.get_text(path)
        if text is None:
            return None
        try:
            return json.loads(text)
        except ValueError:
            self.failures.append(f"{self._base + path} is not JSON")
            return None
