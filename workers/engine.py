"""Engine: admission, prefill, KV transfer and continuous-batching decode on one background thread.

HTTP handlers call ``submit`` (which plans admission synchronously, so a rejection is an immediate
400) and receive events through the request's ``emit`` callback. The engine thread loops:

1. admit waiting requests FIFO while the batch has room and the pools have free pages (a request
   that does not fit yet waits; admission already guarantees it fits an empty pool);
2. prefill each admitted request; in disaggregated mode transfer its KV with a manifest and free the
   prefill pages;
3. run one batched decode step for every running request, with one device-to-host sync;
4. retire finished, failed and aborted requests, freeing their decode pages (LIFO, see kv_cache).

With ``--prefix-cache`` on, step 2 takes the prompt's cached leading pages instead of computing them
and publishes the full pages it computed (see ``workers.prefix_cache``). The cache serves the pool
prefill writes into: the unified pool, or the prefill pool in disaggregated mode, where the transfer
copies cached and computed positions alike into the request's own decode pages (decode pages are
never shared). Before that copy, with ``--verify-ownership``, the prefill pages must hold exactly
the words the request expects, as decode pages must before each decode read. ``--session-cache``
restores in step 2 and saves in step 4 (``workers.session_cache``); ``--bug`` hooks in via ``workers.zoo``.
A joining request takes a batch slot (``workers.slots``): prefill reads its prompt from the slot's
buffer, and its sampling parameters (stop strings, allowed tokens, a thinking budget) go to the
slot's entry of the table each decode step reads (``workers.sampling``).
The prefill and the decode server (``--mode prefill``/``decode``) replace step 2: ``workers.pd_serving``.

``admit_waiting`` and ``decode_once`` are public so that the benchmark can drive the engine without
the thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from kvcanary.workers.admission import AdmissionPlan, AdmissionRejected, plan_admission
from kvcanary.workers.batch import ForeignPages, PagesRefused, RunningBatch
from kvcanary.workers.config import WorkerConfig
from kvcanary.workers.kv_cache import PagePool, build_pools
from kvcanary.workers.metrics import WorkerMetrics
from kvcanary.workers.model import HEAD_DIM, CopyModel
from kvcanary.workers.prefix_cache import PageLease, PrefixCache
from kvcanary.workers.request import (
    OWNERSHIP_VIOLATION,
    ErrorEvent,
    Event,
    FinishEvent,
    Request,
    SamplingParams,
    TokenEvent,
)
from kvcanary.workers.sampling import SamplingTable, stop_split
from kvcanary.workers.session_cache import SessionCache, restore_into, save_from
from kvcanary.workers.slots import Slots
from kvcanary.workers.transfer import TransferManifest, transfer_kv
from kvcanary.workers.zoo import Zoo

log = logging.getLogger("kvcanary.workers.engine")
INTERNAL_ERROR = ErrorEvent(500, "internal engine error", "internal_error", 500)


class Engine:
    """The serving engine of one worker; thread-safe entry points are ``submit``, ``abort`` and ``stop``."""

    def __init__(
        self,
        config: WorkerConfig,
        metrics: WorkerMetrics | None = None,
        *,
        cpu_fast_paths: bool | None = None,
    ) -> None:
        """``cpu_fast_paths`` (default: on a CPU device) picks the verification paths that pay off only
        where the device shares the host's memory; tests turn them off to run the GPU paths on a CPU.
        """
        self.config = config
        self.metrics = metrics if metrics is not None else WorkerMetrics()
        self.device = torch.device(config.device)
        fast = self.device.type == "cpu" if cpu_fast_paths is None else cpu_fast_paths
        self.model = CopyModel(device=self.device, seed=config.seed, ownership_shortcut=fast)
        self.pools = build_pools(config, self.device, HEAD_DIM)
        # The bug zoo (workers.zoo): each defect --bug names, firing on --bug-rate of its triggers.
        self.zoo = Zoo(config.bugs, self.metrics, rate=config.bug_rate, seed=config.seed)
        self.decode_pool = self.pools[config.decode_pool_name]
        self.prefill_pool = self.pools.get("prefill")
        # Pages are taken and given back through PrefixCache objects; an "off" one only passes through.
        cached_pool = config.prefix_cache_pool_name
        self.page_caches = {
            name: PrefixCache(
                pool,
                config.prefix_cache if name == cached_pool else "off",
                partial_key=self.zoo.triggers.get("prefix-key-partial"),
                no_adapter=self.zoo.triggers.get("prefix-key-no-adapter"),
            )
            for name, pool in self.pools.items()
        }
        self.decode_pages = self.page_caches[config.decode_pool_name]
        self.prompt_pages = self.page_caches[config.prompt_pool_name]
        self.batch = RunningBatch(
            max_batch=config.max_batch,
            # A reservation never exceeds the context window nor the pool (see workers.admission).
            max_pages=self.decode_pool.pages_for(
                min(config.context_window, self.decode_pool.capacity_tokens)
            ),
            pool=self.decode_pool,
            verify_ownership=config.verify_ownership,
            host_stores=fast,
        )
        self.metrics.watch_engine(self.pools, self.batch)
        self.slots = Slots(config.max_batch, stale_tokens=self.zoo.triggers.get("slot-stale-tokens"))
        self.sampling = SamplingTable(
            config.max_batch,
            self.device,
            reasoning_end=(config.reasoning_end_str or "").encode(),
            stale_rows=self.zoo.triggers.get("sampling-rows-stale"),
        )
        self._waiting: deque[Request] = deque()
        self._wakeup = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._request_ids = itertools.count(1)
        self._tenants: dict[str, int] = {}
        self.sessions = SessionCache.configured(config, self.zoo.triggers)
        self.largest_batch = 0  # most requests ever decoded in one step (continuous batching at work)

    # --- thread-safe entry points -----------------------------------------------------------------

    def submit(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        *,
        tenant: str,
        emit: Callable[[Event], None],
        cache_salt: str | None = None,
        client_id: str | None = None,
        adapter: str | None = None,
        sampling: SamplingParams | None = None,
    ) -> Request:
        """Plan admission and queue the request; raise ``AdmissionRejected`` (HTTP 400) without queueing.
        ``cache_salt`` (None or a non-empty string) limits prefix cache hits to requests with the same salt.
        """
        plan = self.plan(prompt_ids, max_tokens)
        return self.enqueue(
            plan,
            tenant=tenant,
            emit=emit,
            cache_salt=cache_salt,
            client_id=client_id,
            adapter=adapter,
            sampling=sampling or SamplingParams(),
        )

    def plan(self, prompt_ids: list[int], max_tokens: int) -> AdmissionPlan:
        """Return the admission plan of a prompt, counted; raise ``AdmissionRejected`` (HTTP 400)."""
        try:
            plan = plan_admission(self.config, prompt_ids, max_tokens)
        except AdmissionRejected as rejected:
            self.metrics.admission_rejections.labels(reason=rejected.reason).inc()
            raise
        if plan.placeholder:
            self.metrics.placeholder_substitutions.inc()
            log.warning(
                "placeholder substituted for a %d-token prompt (--admission placeholder)", plan.decode_len
            )
        return plan

    def enqueue(self, plan: AdmissionPlan, **fields: Any) -> Request:
        """Queue a planned request; ``fields`` are the ``Request``'s own (tenant, emit, ...)."""
        with self._wakeup:
            # Ids are unique and never reused: ownership words name the request that wrote a page, and
            # verification needs no two requests to share one (see workers.model.entries_owned).
            request = Request(
                request_id=next(self._request_ids),
                tenant_index=self._tenants.setdefault(fields["tenant"], len(self._tenants) + 1),
                plan=plan,
                **fields,
            )
            self.zoo.submitted(request)
            self._waiting.append(request)
            self._wakeup.notify()
        return request

    def abort(self, request: Request) -> None:
        """Stop ``request`` (its client went away): it gets no more events and its pages are freed."""
        with self._wakeup:
            if request.aborted or request.finished or request.retired:
                return  # over already (an error, or a client leaving as the last chunk went out)
            self.metrics.requests_aborted.inc()
            if not self.zoo.abort(request):
                request.aborted = True
            self._wakeup.notify()

    def start(self) -> None:
        """Start the engine thread."""
        self._thread = threading.Thread(target=self._run, name="kvcanary-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread after its current step."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # --- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not self._stopping and not self._has_work():
                    self._wakeup.wait()
                if self._stopping:
                    return
            try:
                self.admit_waiting()
                if self.batch:
                    self.decode_once()
            except Exception:
                log.exception("engine step failed; failing the running requests")
                self._fail_running(INTERNAL_ERROR)

    def _has_work(self) -> bool:
        """Return True when the engine thread has something to do (called holding ``_wakeup``)."""
        return bool(self._waiting or self.batch)

    def admit_waiting(self) -> int:
        """Move waiting requests into the batch (FIFO) while they fit; return how many joined."""
        joined = 0
        while not self.batch.full:
            with self._wakeup:
                if not self._waiting:
                    break
                request = self._waiting[0]
                if not request.aborted and not self._fits(request.plan):
                    break
                self._waiting.popleft()
            if request.aborted:
                self._let_go(request)
                continue
            try:
                self._join(request)
            except PagesRefused as refused:
                self._refuse_pages(request, refused)
                continue
            except Exception:
                log.exception("request %d could not join the batch", request.request_id)
                self.decode_pages.release(request.pages)
                self._emit(request, INTERNAL_ERROR)
                self._let_go(request)
                continue
            joined += 1
        return joined

    def _join(self, request: Request) -> None:
        """Give an admitted request its slot, prefill it and add it to the running batch."""
        self.slots.take(request, busy=bool(self.batch))
        assert request.slot is not None
        self.sampling.load(request.slot, request.sampling)
        self._prefill(request)
        self.batch.add(request)
        for to, event in self.zoo.joined(request):
            self._deliver(request, to, event)

    def _refuse_pages(self, request: Request, refused: PagesRefused) -> None:
        """Fail a request refused for its pages; give back each of its pages once, except held ones."""
        log.warning("KV ownership violation: %s", refused)
        self.metrics.ownership_violations.inc()
        held = set(refused.held)
        self.decode_pages.release([page for page in dict.fromkeys(request.pages) if page not in held])
        self._emit(request, OWNERSHIP_VIOLATION)
        self._let_go(request)

    def _fits(self, plan: AdmissionPlan) -> bool:
        """Return True when the request's pages can be had now, counting none of its hits (a hit
        needs no fresh page, so a plan that fits without hits fits with them)."""
        decode_pages = self.decode_pool.pages_for(plan.reserve_tokens)
        if self.prefill_pool is not None and not self.prompt_pages.can_alloc(
            self.prefill_pool.pages_for(len(plan.input_ids))
        ):
            return False
        return self.decode_pages.can_alloc(decode_pages)

    def _prefill(self, request: Request) -> None:
        """Compute the request's input K/V into decode pages (through a transfer when disaggregated)."""
        if self.prefill_pool is None:
            lease = self._lease(request, self.decode_pool.pages_for(request.plan.reserve_tokens))
            request.pages, request.shared_words = lease.pages, lease.shared
            self.batch.refuse_shared(request.request_id, request.pages, lease.shared)
            if self.sessions is not None:  # the prefix cache is off: the lease holds no hit
                request.cached_tokens, tier = restore_into(self.sessions, self.decode_pool, request)
                if tier is not None:
                    self.metrics.cached_tokens_by_tier.labels(tier=tier).inc(request.cached_tokens)
            self._compute(self.decode_pool, lease, request, request.cached_tokens)
            return
        prefill_pool = self.prefill_pool
        lease = self._lease(request, prefill_pool.pages_for(len(request.plan.input_ids)))
        try:
            self._compute(prefill_pool, lease, request, lease.cached_tokens)
            self._transfer(request, lease, prefill_pool)
        finally:
            self.prompt_pages.release(lease.pages)

    def _lease(self, request: Request, num_pages: int) -> PageLease:
        """Take the prompt's pages from the prefix cache (hits, then fresh pages) and count the lookup."""
        cache, input_ids = self.prompt_pages, request.plan.input_ids
        lease = cache.lease(
            input_ids,
            num_pages,
            request_id=request.request_id,
            tenant=request.tenant,
            cache_salt=request.cache_salt,
            adapter=request.adapter,
        )
        request.cached_tokens = lease.cached_tokens
        if cache.enabled:
            self.metrics.prefix_cache_queries.inc(len(input_ids))
            self.metrics.prefix_cache_hits.inc(lease.cached_tokens)
            if lease.cached_tokens:
                self.metrics.cached_tokens_by_tier.labels(tier="prefix").inc(lease.cached_tokens)
        return lease

    def _compute(self, pool: PagePool, lease: PageLease, request: Request, start: int) -> None:
        """Prefill positions from ``start`` (those no cache served); publish the full pages computed."""
        self.model.prefill(
            pool,
            lease.pages,
            list(self.slots.prompt(request)),
            request_id=request.request_id,
            tenant_index=request.tenant_index,
            start=start,
        )
        self.prompt_pages.publish(lease)

    def _transfer(self, request: Request, lease: PageLease, prefill_pool: PagePool) -> None:
        """Copy the prompt's K/V from its prefill pages into newly allocated decode pages."""
        plan, rid = request.plan, request.request_id
        if self.config.verify_ownership and self.prompt_pages.enabled:
            self._verify_prefill_pages(request, lease, prefill_pool)
        # Decode preallocates for the length it believes (decode_len), whatever prefill computed.
        self._preallocate(request)
        manifest = TransferManifest(
            request_id=rid,
            tenant=request.tenant,
            num_tokens=len(plan.input_ids),
            src_pages=tuple(lease.pages),
            dst_pages=tuple(request.pages[: len(lease.pages)]),
        )
        transfer_kv(manifest, prefill_pool, self.decode_pool, tenant_index=request.tenant_index)

    def _preallocate(self, request: Request) -> None:
        """Give the request its decode pages for the length it believes, refusing pages held twice."""
        pages = self.decode_pool.pages_for(request.plan.reserve_tokens)
        request.pages = self.decode_pool.alloc(pages, request_id=request.request_id)
        self.batch.refuse_shared(request.request_id, request.pages)

    def _verify_prefill_pages(self, request: Request, lease: PageLease, pool: PagePool) -> None:
        """Raise ``ForeignPages`` unless every prefill page holds the word the request expects: the
        cache's for the pages it owns, the request's own with the slots it wrote for the others."""
        length, size = len(request.plan.input_ids), pool.page_size
        expected = [
            lease.shared.get(j, int(pool.ownership_word(request.request_id, min(size, length - j * size))))
            for j in range(len(lease.pages))
        ]
        self.batch.entries_checked += len(expected)
        if not pool.holds_words(lease.pages, expected):
            raise ForeignPages(request.request_id)

    def decode_once(self) -> None:
        """Run one decode step for the whole batch, emit its tokens and retire whoever is done."""
        self.largest_batch = max(self.largest_batch, len(self.batch))
        step = self.batch.decode_step()
        entries = self.sampling.entries(self.batch.requests)
        step.allowed_tokens = self.sampling.masks(entries)
        tokens = self.zoo.step_tokens(self.batch.requests, self.model.decode(self.decode_pool, step).tolist())
        tokens = self.sampling.force(entries, tokens)
        now = time.monotonic()
        done: list[int] = []
        for row, (request, token) in enumerate(zip(self.batch.requests, tokens, strict=True)):
            if request.aborted:
                done.append(row)
            elif token < 0:
                self.metrics.ownership_violations.inc()
                log.warning(
                    "KV ownership violation: request %d refused (tenant index %d)",
                    request.request_id,
                    request.tenant_index,
                )
                self._emit(request, OWNERSHIP_VIOLATION)
                done.append(row)
            elif self._advance(request, token, now, self.sampling.stops(entries[row])):
                done.append(row)
        self._retire(done)

    def _advance(self, request: Request, token: int, now: float, stops: tuple[bytes, ...]) -> bool:
        """Record ``token`` for ``request`` and send what may be sent; return True when the request
        finished with it (its budget, its pages or one of ``stops`` ran out)."""
        if not request.generated:
            self.metrics.time_to_first_token.observe(now - request.submitted_at)
        request.generated.append(token)
        if stops:
            sendable, stopped = stop_split(request.generated, request.sent, stops)
        else:
            sendable, stopped = len(request.generated), False
        reason = "stop" if stopped else request.finish_reason(self.config.page_size)
        if reason is not None and not stopped:
            sendable = len(request.generated)  # the answer ends unstopped: nothing is held back
        for held in request.generated[request.sent : sendable]:
            self._emit(request, TokenEvent(held))
        request.sent = sendable
        if reason is None:
            return False
        request.finished = True
        cached = request.cached_tokens if self.prompt_pages.enabled or self.sessions is not None else None
        self._emit(request, FinishEvent(reason, request.plan.prompt_tokens, len(request.generated), cached))
        return True

    def _emit(self, request: Request, event: Event) -> None:
        """Hand ``event`` to the request's submitter; a submitter that cannot take it aborts its request."""
        for to, routed in self.zoo.deliveries(request, event):
            self._deliver(request, to, routed)

    def _deliver(self, request: Request, to: Request, event: Event) -> None:
        try:
            to.emit(event)
        except Exception:
            # E.g. the handler's event loop has closed: nobody waits for this request any more.
            log.exception("could not deliver an event of request %d; aborting it", request.request_id)
            request.aborted = True

    def _retire(self, rows: list[int]) -> None:
        for row in rows:
            request = self.batch.requests[row]
            if self.sessions is not None and request.finished:
                save_from(self.sessions, self.decode_pool, request)
            self.decode_pages.release(request.pages)
            self._let_go(request)
        self.batch.remove(rows)
        if not self.batch:
            self.slots.drained()

    def _let_go(self, request: Request) -> None:
        request.retired = True
        self.slots.free(request)
        self.sampling.forget(request)
        self.zoo.retired(request)

    def _fail_running(self, error: ErrorEvent) -> None:
        rows = list(range(len(self.batch)))
        for request in self.batch.requests:
            if not request.aborted:
                self._emit(request, error)
        self._retire(rows)
