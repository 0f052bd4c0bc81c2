"""The tap as a LiteLLM proxy callback.

In the proxy's ``config.yaml``::

    litellm_settings:
      callbacks: kvcanary.tap.litellm.tap

LiteLLM calls :meth:`KVCanaryTap.async_log_success_event` (and the failure twin) after the
response has gone to the client, with ``kwargs["standard_logging_object"]``: the request's id,
deployment, caller and usage, the messages and the assembled response (streams included). The
hook turns it into an :class:`~kvcanary.tap.record.Exchange` and queues it; summarizing and
sending happen on the tap's own thread. Configured from the environment (``kvcanary.tap``).

When the proxy shuts down (SIGTERM), the tap sends what it still holds after LiteLLM has drained
its logging callbacks (:func:`flush_in_proxy_shutdown`): the proxy, like uvicorn under it, ends
by raising SIGTERM again, so the process dies by the signal and no exit hook would run.

With ``KVCANARY_TAP_QUARANTINE=1`` the same callback also keeps the deployments the monitor
quarantined out of routing (:class:`KVCanaryQuarantiningTap`, ``kvcanary/tap/containment/litellm_filter.py``),
and prompts off deployments whose pool surely cannot hold them (``kvcanary/tap/containment/guard.py``);
without it the callback is the plain tap and LiteLLM runs no deployment filter for it.

If the proxy cannot import an installed module by that path, put a file ``kvcanary_tap.py``
beside the config holding ``from kvcanary.tap.litellm import tap`` and name
``kvcanary_tap.tap`` instead (LiteLLM resolves callback paths from the config's folder).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import sys
from typing import Any

from litellm.integrations.custom_logger import CustomLogger

from kvcanary.tap import Tap
from kvcanary.tap.containment import watch_from_env
from kvcanary.tap.containment.guard import AdmissionGuard
from kvcanary.tap.containment.litellm_filter import QuarantineFilter
from kvcanary.tap.litellm_payload import exchange_of
from kvcanary.tap.record import Exchange

log = logging.getLogger("kvcanary.tap")


def _failure_status(kwargs: dict[str, Any]) -> int:
    exc = kwargs.get("exception")
    code = getattr(exc, "status_code", None)
    return code if isinstance(code, int) else 500


def _refused(exchange: Exchange, exception: Any) -> Exchange:
    """Return ``exchange`` as a refusal where the tap's own filter refused the request (LiteLLM
    logs it as a failure with no deployment): the record names the deployment kept off, so the
    monitor counts the refusal against its target."""
    refusal = getattr(exception, "kvcanary_refusal", None)
    if not isinstance(refusal, tuple):
        return exchange
    api_base, why = refusal
    return dataclasses.replace(exchange, api_base=api_base or exchange.api_base, refused=why)


class KVCanaryTap(CustomLogger):  # type: ignore[misc]  # LiteLLM ships no type hints here
    """LiteLLM's logging hooks → the tap."""

    def __init__(self, tap: Tap):
        super().__init__()
        self.tap = tap
        self._warned_redacted = False

    def _observe(self, kwargs: dict[str, Any], status: int) -> None:
        payload = kwargs.get("standard_logging_object")
        if not isinstance(payload, dict):
            return
        try:
            exchange = _refused(exchange_of(payload, status), kwargs.get("exception"))
            if exchange.extra.get("redacted") and not self._warned_redacted:
                self._warned_redacted = True
                log.error(
                    "kvcanary tap: LiteLLM redacts messages (turn_off_message_logging or a caller's "
                    "redaction): those requests are sent without sizes or prints, and the capacity, "
                    "tokens, marker and overlap checks cannot judge them"
                )
            self.tap.observe(exchange)
        except Exception:  # a tap never fails a request, nor LiteLLM's other callbacks
            log.exception("kvcanary tap: cannot read LiteLLM's logging payload")

    async def async_log_success_event(
        self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        self._observe(kwargs, 200)

    async def async_log_failure_event(
        self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        self._observe(kwargs, _failure_status(kwargs))


class KVCanaryQuarantiningTap(KVCanaryTap):
    """The tap, and LiteLLM's router kept off the deployments the monitor quarantined and, where
    the monitor publishes a target's admission facts, off those whose KV pool surely cannot hold
    the prompt (``kvcanary/tap/containment/guard.py``): LiteLLM runs a callback's
    ``async_filter_deployments`` only where its class overrides it, hence a class of its own."""

    def __init__(self, tap: Tap, quarantine: QuarantineFilter, guard: AdmissionGuard | None = None):
        super().__init__(tap)
        self.quarantine = quarantine
        self.guard = guard

    async def async_filter_deployments(
        self,
        model: str,
        healthy_deployments: list[Any],
        messages: Any,
        request_kwargs: dict[str, Any] | None = None,
        parent_otel_span: Any = None,
    ) -> list[Any]:
        kept = self.quarantine.keep(model, healthy_deployments)
        if self.guard is None:
            return kept
        return await self.guard.admit(model, kept, messages, request_kwargs)


def callback_from_env() -> KVCanaryTap:
    """Return the tap configured from the environment, quarantining where it is switched on."""
    tap = Tap.from_env()
    watch = watch_from_env()
    if watch is None:
        return KVCanaryTap(tap)
    return KVCanaryQuarantiningTap(tap, QuarantineFilter(watch), AdmissionGuard(watch))


def flush_in_proxy_shutdown(tap: Tap) -> bool:
    """Make the proxy's shutdown send the tap's queued records first; False where no proxy runs
    here (the SDK alone: the tap's exit hook covers a normal exit)."""
    server = sys.modules.get("litellm.proxy.proxy_server")
    shutdown = getattr(server, "proxy_shutdown_event", None)
    if shutdown is None or getattr(shutdown, "kvcanary_tap", None) is tap:
        return False

    @functools.wraps(shutdown)
    async def flushed_then_shut_down(*args: Any, **kwargs: Any) -> Any:
        # Off the loop: the flush waits for acknowledgements (up to EXIT_FLUSH_SECONDS).
        await asyncio.to_thread(tap.shutdown)
        return await shutdown(*args, **kwargs)

    flushed_then_shut_down.kvcanary_tap = tap  # type: ignore[attr-defined]
    # The lifespan looks the name up when it shuts down, so replacing the module's global is enough.
    server.proxy_shutdown_event = flushed_then_shut_down  # type: ignore[union-attr]
    return True


#: The instance ``litellm_settings.callbacks`` names, built when the proxy loads its config: a
#: missing or wrong variable stops the proxy there with a message naming it, not at a request.
tap = callback_from_env()
flush_in_proxy_shutdown(tap.tap)
