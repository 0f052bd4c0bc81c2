"""A prefill or decode server's data-parallel ranks (``--dp-size N``), as SGLang runs them.

With DP attention SGLang runs one scheduler per rank, each with a KV pool sized on its own GPU, and
its data-parallel controller hands each request to one rank:

- the rank the request names (``routed_dp_rank``; ``data_parallel_rank`` in releases before it);
- else, on a prefill server, ``bootstrap_room % dp_size`` (``follow_bootstrap_room``, the prefill
  default), which is also where its decode server looks for the room's K/V;
- else, on a decode server, the next rank in turn (``round_robin``, the decode default).

So a rank is a path of its own, and a health check that always sends room 0 reaches rank 0 alone
(dynamo#6004). Here each rank is an engine (``workers.pd_serving``) with its own pool; the prefill
ranks share one room table and one bootstrap listener, since rooms are unique across ranks and the
decode server fetches a room by its number alone.
"""

from __future__ import annotations

import itertools
from typing import Any

from kvcanary.workers.config import WorkerConfig
from kvcanary.workers.engine import Engine
from kvcanary.workers.errors import WorkerError
from kvcanary.workers.metrics import WorkerMetrics
from kvcanary.workers.pd_serving import DecodeEngine, PrefillEngine, build_engine
from kvcanary.workers.pd_transfer import BootstrapServer, RoomTable
from kvcanary.workers.protocol import GenerationRequest


class Ranks:
    """The engines of a server's ranks and the rule that picks one per request (module doc)."""

    def __init__(self, config: WorkerConfig, metrics: WorkerMetrics) -> None:
        self.config = config
        self.bootstrap: BootstrapServer | None = None
        if config.mode == "prefill" and config.dp_size > 1:
            assert config.bootstrap_port is not None  # WorkerConfig requires it in prefill mode
            rooms = RoomTable(config.kv_transfer_timeout)
            self.bootstrap = BootstrapServer((config.host, config.bootstrap_port), rooms)
            engines: list[Engine] = [
                PrefillEngine(config.for_rank(rank), metrics, rooms=rooms) for rank in range(config.dp_size)
            ]
        elif config.mode == "decode":
            engines = [DecodeEngine(config.for_rank(rank), metrics) for rank in range(config.dp_size)]
        else:
            engines = [build_engine(config, metrics)]
        self.engines = engines
        self._turn = itertools.count()

    def start(self) -> None:
        """Start the shared bootstrap listener, if any, and every rank's engine thread."""
        if self.bootstrap is not None:
            self.bootstrap.start()
        for engine in self.engines:
            engine.start()

    def stop(self) -> None:
        """Stop every rank's engine thread and the shared listener."""
        for engine in self.engines:
            engine.stop()
        if self.bootstrap is not None:
            self.bootstrap.close()

    def pick(self, body: GenerationRequest) -> Engine:
        """Return the engine of the rank that serves ``body`` (module doc); 400 for a rank this
        server does not have."""
        if len(self.engines) == 1 and body.routed_dp_rank is None and body.data_parallel_rank is None:
            return self.engines[0]
        field = "routed_dp_rank" if body.routed_dp_rank is not None else "data_parallel_rank"
        named = body.routed_dp_rank if body.routed_dp_rank is not None else body.data_parallel_rank
        if named is not None:
            if named >= len(self.engines):
                ranks = len(self.engines)
                message = f"{field} {named} is not a rank of this server (dp_size {ranks})"
                raise WorkerError(400, message, param=field)
            return self.engines[named]
        if self.config.mode == "prefill" and body.bootstrap_room is not None:
            return self.engines[body.bootstrap_room % len(self.engines)]
        return self.engines[next(self._turn) % len(self.engines)]

    def internal_states(self) -> list[dict[str, Any]]:
        """Return each rank's scheduler facts as SGLang's server info lists them (``internal_states``)."""
        return [
            {"dp_rank": rank, "max_total_num_tokens": engine.config.admission_pool_tokens}
            for rank, engine in enumerate(self.engines)
        ]
