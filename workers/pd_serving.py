"""The engine of a prefill server and of a decode server (``--mode prefill`` and ``--mode decode``).

Both are the in-process engine (``workers.engine``) with one step replaced, so that admission, the
prefix cache, the running batch and owner verification stay one piece of code:

- ``PrefillEngine`` admits and computes a prompt into its pool exactly as the in-process
  disaggregated mode does (the placeholder defect included), then, instead of copying into a decode
  pool of its own, stages the room's K/V for the decode server (``workers.pd_transfer``) and holds
  the pages until the decode server has them; only then are they freed and the request finished.
- With ``--kv-checksum`` the prefill server digests the room's rows as its pages hold them
  (``workers.pd_transfer.kv_digest``) and sends the digest with them; the decode server checks it
  (``workers.pd_api``). ``--bug pd-transfer-corrupt`` (the bug zoo) flips the sign bit of every value
  in the first page's V rows of the copy that goes on the wire, after the digest was taken: bytes
  altered between one server's pages and the other's, which sglang#39229 traces to an RDMA write
  landing in a slot reused meanwhile, or a stale sender writing after an abort, and SGLang's own
  abort path to "hardware or transport". Its trigger is every hand-off; with ``--bug-rate`` it acts
  on a fraction of them. Without the checksum the decode server serves the altered K/V: the answer's
  first page comes out wrong, with no error.
- ``DecodeEngine`` preallocates decode pages for the length it believes, writes exactly the
  positions the prefill server sent (the rest keep whatever they held, as ``transfer_kv`` does) and
  decodes as the in-process engine does. With ``--verify-ownership`` a page the request did not fill
  fails the request closed before it is read.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import replace
from typing import Any

from kvcanary.workers.admission import AdmissionPlan, AdmissionRejected
from kvcanary.workers.config import WorkerConfig
from kvcanary.workers.engine import Engine
from kvcanary.workers.metrics import WorkerMetrics
from kvcanary.workers.pd_transfer import BootstrapServer, KVHandoff, Outcome, RoomTable, flip_signs, kv_digest
from kvcanary.workers.prefix_cache import PageLease
from kvcanary.workers.request import ErrorEvent, FinishEvent, Request
from kvcanary.workers.transfer import TransferManifest, read_positions, write_positions

log = logging.getLogger("kvcanary.workers.pd_serving")
#: The status a room let go because its client left is answered with (nginx's "client closed").
CLIENT_GONE = 499
TRANSFER_FAILED = ErrorEvent(500, "KV transfer to the decode server failed", "kv_transfer_failed", 500)


class PrefillEngine(Engine):
    """Admit and prefill; hand each room's K/V to the decode server that asks for it."""

    def __init__(
        self,
        config: WorkerConfig,
        metrics: WorkerMetrics | None = None,
        rooms: RoomTable | None = None,
        **options: Any,
    ) -> None:
        """``rooms``: the server's room table when data-parallel ranks share one bootstrap listener
        (``workers.dp``, which runs it); without it the engine runs a listener of its own."""
        super().__init__(config, metrics, **options)
        self.rooms = rooms if rooms is not None else RoomTable(config.kv_transfer_timeout)
        assert config.bootstrap_port is not None  # WorkerConfig requires it in prefill mode
        self.bootstrap = (
            BootstrapServer((config.host, config.bootstrap_port), self.rooms) if rooms is None else None
        )
        self._held: dict[int, tuple[Request, PageLease]] = {}
        self._handed: deque[tuple[int, Outcome]] = deque()

    def start(self) -> None:
        """Start the bootstrap listener (when the engine has one) and the engine thread."""
        if self.bootstrap is not None:
            self.bootstrap.start()
        super().start()

    def stop(self) -> None:
        """Stop the engine thread and close the bootstrap listener."""
        super().stop()
        if self.bootstrap is not None:
            self.bootstrap.close()

    def submit_room(self, room: int, prompt_ids: list[int], max_tokens: int, **fields: Any) -> Request:
        """Plan and queue a room's prompt; a refusal is also the answer the decode server gets."""
        try:
            plan = self.plan(prompt_ids, max_tokens)
        except AdmissionRejected as rejected:
            self.rooms.refuse(room, 400, rejected.message)
            raise
        return self.enqueue(plan, bootstrap_room=room, **fields)

    def _has_work(self) -> bool:
        return super()._has_work() or bool(self._handed)

    def _fits(self, plan: AdmissionPlan) -> bool:
        """Return True when the prompt's prefill pages can be had now (there is no decode pool here)."""
        assert self.prefill_pool is not None
        return self.prompt_pages.can_alloc(self.prefill_pool.pages_for(len(plan.input_ids)))

    def admit_waiting(self) -> int:
        """Finish the rooms the decode servers took (freeing their pages), then admit as usual."""
        self._finish_handed()
        return super().admit_waiting()

    def _join(self, request: Request) -> None:
        """Compute the prompt into prefill pages and stage its rows; the pages stay held until taken."""
        pool, room = self.prefill_pool, request.bootstrap_room
        assert pool is not None and room is not None
        lease = self._lease(request, pool.pages_for(len(request.plan.input_ids)))
        try:
            self._compute(pool, lease, request, lease.cached_tokens)
            if self.config.verify_ownership and self.prompt_pages.enabled:
                self._verify_prefill_pages(request, lease, pool)
            k, v = read_positions(pool, lease.pages, len(request.plan.input_ids))
        except BaseException:
            self.prompt_pages.release(lease.pages)
            self.rooms.refuse(room, 500, f"prefill of room {room} failed")
            raise
        k, v = k.cpu(), v.cpu()
        digest = kv_digest(k, v) if self.config.kv_checksum else None
        corrupt = self.zoo.triggers.get("pd-transfer-corrupt")
        if corrupt is not None and corrupt.fires():
            v = flip_signs(v, self.config.page_size)  # THE DEFECT: the rows change on their way out
        handoff = KVHandoff(
            room=room,
            tenant=request.tenant,
            request_id=request.request_id,
            input_ids=request.plan.input_ids,
            src_pages=tuple(lease.pages),
            k=k,
            v=v,
            checksum=digest,
        )
        self._held[request.request_id] = (request, lease)
        rid = request.request_id
        self.rooms.stage(handoff, lambda outcome: self._handed_off(rid, outcome))
        if request.aborted:  # its client left while it was computed
            self.rooms.abandon(room, CLIENT_GONE)

    def abort(self, request: Request) -> None:
        """Stop ``request`` (its client went away); a room already staged is let go at once, its
        pages freed, rather than held for a decode server until the hand-off times out (SGLang's
        prefill server aborts a request whose client disconnected in the same way)."""
        room = request.bootstrap_room
        if request.request_id in self._held and room is not None:
            self.metrics.requests_aborted.inc()
            self.rooms.abandon(room, CLIENT_GONE)
            return
        super().abort(request)

    def _handed_off(self, request_id: int, outcome: Outcome) -> None:
        """Called from the bootstrap thread: let the engine thread free the request's pages."""
        with self._wakeup:
            self._handed.append((request_id, outcome))
            self._wakeup.notify()

    def _finish_handed(self) -> None:
        """Free the pages of every room a decode server took (or failed to) and answer its request."""
        while True:
            with self._wakeup:
                if not self._handed:
                    return
                request_id, outcome = self._handed.popleft()
            request, lease = self._held[request_id]
            self.prompt_pages.release(lease.pages)
            if outcome is True:
                request.finished = True
                plan = request.plan
                self._emit(request, FinishEvent("stop", plan.prompt_tokens, 0, self._cached(request)))
            elif outcome is not False:  # the decode server's refusal is this request's answer too
                refused = f"the decode server refused room {request.bootstrap_room} ({outcome})"
                self._emit(request, ErrorEvent(outcome, refused, "decode_refused", outcome))
            else:
                self.metrics.kv_transfer_failures.labels(side="prefill").inc()
                self._emit(request, TRANSFER_FAILED)
            self._let_go(request)
            del self._held[request_id]

    def _let_go(self, request: Request) -> None:
        """Let go of a request; one aborted before its room was staged tells its decode server so,
        which would otherwise wait out ``--kv-transfer-timeout`` for K/V that never come."""
        staged = request.request_id in self._held
        if request.aborted and not staged and request.bootstrap_room is not None:
            self.rooms.refuse(request.bootstrap_room, 500, "the prefill request was aborted")
        super()._let_go(request)

    def _cached(self, request: Request) -> int | None:
        return request.cached_tokens if self.prompt_pages.enabled else None


class DecodeEngine(Engine):
    """Decode what a prefill server handed over, into pages preallocated for the believed length."""

    def enqueue_received(self, plan: AdmissionPlan, handoff: KVHandoff, **fields: Any) -> Request:
        """Queue a request planned here whose prompt K/V ``handoff`` carries; its usage counts the
        tokens prefill transferred (one under the placeholder defect, as in the incident)."""
        if handoff.num_tokens > plan.decode_len:
            raise ValueError(
                f"room {handoff.room}: prefill sent {handoff.num_tokens} positions for a "
                f"{plan.decode_len}-token prompt"
            )
        received = replace(
            plan, input_ids=handoff.input_ids, placeholder=handoff.num_tokens != plan.decode_len
        )
        return self.enqueue(received, handoff=handoff, bootstrap_room=handoff.room, **fields)

    def _prefill(self, request: Request) -> None:
        """Preallocate decode pages for the believed length and write the received positions only."""
        handoff = request.handoff
        assert handoff is not None
        self._preallocate(request)
        manifest = TransferManifest(
            request_id=request.request_id,
            tenant=request.tenant,
            num_tokens=handoff.num_tokens,
            src_pages=handoff.src_pages,
            dst_pages=tuple(request.pages),
        )
        write_positions(self.decode_pool, manifest, handoff.k, handoff.v, tenant_index=request.tenant_index)
        request.handoff = None  # the rows are in the pool now


def build_engine(config: WorkerConfig, metrics: WorkerMetrics | None = None) -> Engine:
    """Return the engine of ``config``'s mode: a prefill server's, a decode server's, or the whole one."""
    if config.mode == "prefill":
        return PrefillEngine(config, metrics)
    if config.mode == "decode":
        return DecodeEngine(config, metrics)
    return Engine(config, metrics)
