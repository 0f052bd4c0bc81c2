"""The bug zoo's defects in how the engine hands events to requests (``--bug NAME``).

Each class is one real engine's defect, implemented as that engine had it, and wired into
``workers.engine`` at five points: a request is submitted, joins the batch, is aborted by its
client, gets its token of a decode step, and retires; and every event the engine emits goes
through :meth:`Zoo.deliveries`. Without
its flag a defect is not built, and events go to the request that produced them. The others live
in what they break: the prefix-cache keys (``prefix-key-partial``, ``prefix-key-no-adapter``) in
``workers.prefix_cache``, the session cache's (``session-restore``) in ``workers.session_cache``
and its offload tier's (``session-offload-chunks``) in ``workers.offload``, the batch slots'
(``slot-stale-tokens``) in ``workers.slots`` and the sampling table's (``sampling-rows-stale``) in
``workers.sampling``, each given its :class:`BugTrigger` from :attr:`Zoo.triggers`;
``docs/architecture.md`` lists them all with the cases they follow and the probe kinds that catch
them.

Only the engine thread calls these, except :meth:`Zoo.abort` (an HTTP handler, under the engine's
lock); the sets it touches are read by the engine thread one operation at a time.
"""

from __future__ import annotations

import random
from collections import deque

from kvcanary.workers.metrics import WorkerMetrics
from kvcanary.workers.request import ErrorEvent, Event, FinishEvent, Request

Delivery = tuple[Request, Event]


class BugTrigger:
    """Whether one defect fires on one of its trigger events: always, or on a fraction ``rate`` of
    them (``--bug-rate``, drawn from ``--seed``), as real defects fire on some events, not all.
    Every event and every firing is counted (``kvcanary_bug_trigger_events_total{bug}``,
    ``kvcanary_bug_fired_total{bug}``), so a benchmark can count what a probe needed."""

    def __init__(self, bug: str, rate: float, rng: random.Random, metrics: WorkerMetrics) -> None:
        self.bug, self.rate, self._rng = bug, rate, rng
        self._events = metrics.bug_trigger_events.labels(bug=bug)
        self._fired = metrics.bug_fired.labels(bug=bug)

    def fires(self) -> bool:
        """Count one trigger event and return whether the defect acts on it."""
        self._events.inc()
        fired = self.rate >= 1.0 or self._rng.random() < self.rate
        if fired:
            self._fired.inc()
        return fired


class RidRoutes:
    """``rid-collision`` (sgl-project/sglang#24223): output is routed by the client's request id, as
    SGLang's tokenizer manager kept one state per ``rid``; a second request with an id in flight
    overwrote the first one's state, and the first one's tokens went to the second one's client."""

    def __init__(self, trigger: BugTrigger) -> None:
        self._routes: dict[str, Request] = {}
        self._trigger = trigger
        self._spared: set[int] = set()  # colliding requests the defect did not act on: routed to themselves

    def submitted(self, request: Request) -> None:
        """Route the request's id to it; a second request with an id in flight is the trigger."""
        cid = request.client_id
        if cid is None:
            return
        if cid in self._routes and not self._trigger.fires():
            self._spared.add(request.request_id)
            return
        self._routes[cid] = request  # THE DEFECT, on a collision: the newest request takes the id over

    def route(self, request: Request) -> Request:
        if request.client_id is None or request.request_id in self._spared:
            return request
        return self._routes.get(request.client_id, request)

    def retired(self, request: Request) -> None:
        self._spared.discard(request.request_id)
        if request.client_id is not None and self._routes.get(request.client_id) is request:
            del self._routes[request.client_id]


class OrphanedOutput:
    """``abort-in-flight``: a request whose client hung up keeps decoding (its work was in flight),
    and its output goes to the next request the engine admits, which answers with the rest of the
    abandoned answer as if it were its own. As in the 2023 ChatGPT incident (redis-py#2624: a
    request cancelled after it was sent left its reply on a pooled connection, and the next user
    read it) and vllm#45357 (a step still in flight for a request whose slots were handed on).

    An orphan's events wait until a request joins; that request then gets them, and its own events
    wait until the orphan's last one (they go to a handler that has already answered).
    """

    def __init__(self, trigger: BugTrigger) -> None:
        self._trigger = trigger
        self._orphans: set[int] = set()
        self._unclaimed: deque[Request] = deque()
        self._claimant: dict[int, Request] = {}  # orphan id -> the request that gets its output
        self._serving: dict[int, Request] = {}  # claimant id -> the orphan it is answering for
        self._held: dict[int, list[Event]] = {}  # request id -> events not delivered yet
        self._queued: set[int] = set()  # orphans waiting in _unclaimed

    def abort(self, request: Request) -> bool:
        """Take ``request`` as an orphan (THE DEFECT: it is not stopped) when the defect fires on
        this abort; return whether it did (otherwise the engine stops it)."""
        if request.request_id in self._orphans:
            return True
        if not self._trigger.fires():
            return False
        self._orphans.add(request.request_id)
        self._queued.add(request.request_id)
        self._unclaimed.append(request)  # the next request to join gets its output
        return True

    def joined(self, request: Request) -> list[Delivery]:
        """Hand the oldest unclaimed orphan's output to ``request``, which just joined the batch."""
        if request.request_id in self._orphans:
            return []
        if self._unclaimed:
            orphan = self._unclaimed.popleft()
            self._queued.discard(orphan.request_id)
            self._claimant[orphan.request_id] = request
            self._serving[request.request_id] = orphan
            held = self._held.pop(orphan.request_id, [])
            return [d for event in held for d in self._to_claimant(orphan, request, event)]
        return []

    def route(self, request: Request, event: Event) -> list[Delivery]:
        rid = request.request_id
        if rid in self._orphans:
            claimant = self._claimant.get(rid)
            if claimant is None:
                self._held.setdefault(rid, []).append(event)
                return []
            return self._to_claimant(request, claimant, event)
        if rid in self._serving:
            self._held.setdefault(rid, []).append(event)
            return []
        return [(request, event)]

    def _to_claimant(self, orphan: Request, claimant: Request, event: Event) -> list[Delivery]:
        out: list[Delivery] = [(claimant, event)]
        if isinstance(event, FinishEvent | ErrorEvent):  # the orphan's answer is over
            self._orphans.discard(orphan.request_id)
            self._claimant.pop(orphan.request_id, None)
            self._serving.pop(claimant.request_id, None)
            if claimant.request_id not in self._orphans:  # else its own events wait for its claimant
                out += [(claimant, own) for own in self._held.pop(claimant.request_id, [])]
        return out

    def retired(self, request: Request) -> None:
        """Forget an orphan that ended with no event to hand on (it never ran)."""
        rid = request.request_id
        if rid in self._orphans and rid not in self._held and rid not in self._claimant:
            self._orphans.discard(rid)
            self._queued.discard(rid)
            if request in self._unclaimed:
                self._unclaimed.remove(request)


class CrossedRows:
    """``batch-crossed``: with a full batch of mixed sampling parameters, each row gets another row's
    token. The sampler handles rows grouped by their parameters (here the new-token budget) and
    writes the tokens back in group order, not batch order, as vllm#5607 (penalties computed per
    batch), vllm#14645 (batch order inferred from dict keys with mixed speculative lengths) and
    mlx-lm#965 (answers to other prompts at 16 concurrent requests, 15 of 20 runs) went wrong. The
    grouping is stable while the batch is, so one request streams another's whole answer."""

    #: Rows from which the batch counts as full enough to be grouped (mlx-lm#965: 16).
    MIN_ROWS = 8

    def __init__(self, trigger: BugTrigger) -> None:
        self._trigger = trigger
        self._full = False  # the batch is full and mixed now
        self._crossing = False

    def scatter(self, requests: list[Request], tokens: list[int]) -> list[int]:
        """Return the token each row gets from a step that computed ``tokens`` in batch order."""
        budgets = [r.plan.max_new_tokens for r in requests]
        if len(requests) < self.MIN_ROWS or len(set(budgets)) < 2:
            self._full = False
            return tokens
        if not self._full:  # a full, mixed batch formed: the trigger; the outcome lasts while it does
            self._full, self._crossing = True, self._trigger.fires()
        if not self._crossing:
            return tokens
        grouped = sorted(range(len(requests)), key=budgets.__getitem__)
        return [tokens[row] for row in grouped]  # THE DEFECT: group order read as batch order


class Zoo:
    """The defects ``bugs`` names, behind one interface the engine calls."""

    def __init__(
        self, bugs: frozenset[str], metrics: WorkerMetrics, *, rate: float = 1.0, seed: int = 0
    ) -> None:
        rng = random.Random(seed)
        self.triggers = {bug: BugTrigger(bug, rate, rng, metrics) for bug in sorted(bugs)}
        self.rid_routes = RidRoutes(self.triggers["rid-collision"]) if "rid-collision" in bugs else None
        self.orphans = OrphanedOutput(self.triggers["abort-in-flight"]) if "abort-in-flight" in bugs else None
        self.crossed_rows = CrossedRows(self.triggers["batch-crossed"]) if "batch-crossed" in bugs else None

    def submitted(self, request: Request) -> None:
        if self.rid_routes is not None:
            self.rid_routes.submitted(request)

    def abort(self, request: Request) -> bool:
        """Return True when a defect took the abort over (the request is then not stopped)."""
        return self.orphans is not None and self.orphans.abort(request)

    def joined(self, request: Request) -> list[Delivery]:
        return self.orphans.joined(request) if self.orphans is not None else []

    def deliveries(self, request: Request, event: Event) -> list[Delivery]:
        """Return to whom ``event`` of ``request`` goes: ``request`` itself unless a defect says otherwise."""
        to = self.rid_routes.route(request) if self.rid_routes is not None else request
        if self.orphans is not None:
            return [(to if r is request else r, e) for r, e in self.orphans.route(request, event)]
        return [(to, event)]

    def step_tokens(self, requests: list[Request], tokens: list[int]) -> list[int]:
        """Return the token each row of a decode step gets (``tokens``, in batch order, unless crossed)."""
        return self.crossed_rows.scatter(requests, tokens) if self.crossed_rows is not None else tokens

    def retired(self, request: Request) -> None:
        if self.rid_routes is not None:
            self.rid_routes.retired(request)
        if self.orphans is not None:
            self.orphans.retired(request)
