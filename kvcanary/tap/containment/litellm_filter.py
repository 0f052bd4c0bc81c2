"""Deployments the monitor quarantined, kept out of a LiteLLM router's choice.

LiteLLM's router hands each callback that overrides ``CustomLogger.async_filter_deployments`` the
deployments of the model group a request asked for, before it picks one (on every try, a retry's
included), and routes among those the callbacks leave; an error a filter raises becomes the
request's. :class:`~kvcanary.tap.litellm.KVCanaryQuarantiningTap` is that callback and
:meth:`QuarantineFilter.keep` its work: a deployment whose ``litellm_params.api_base`` has the key of
an enforced entry of the monitor's set is left out; when that leaves none, the request fails at once
with :class:`DeploymentsQuarantined` (503, naming the targets and incidents), never a hang nor a
deployment found leaking. An observe-mode entry is only counted (and logged once per incident).

The work per request is one read of the watch's set and, only while something is quarantined, a
dict lookup per deployment: nothing here waits for the monitor. Standard library only (LiteLLM is
not imported here), so it runs and is tested without LiteLLM.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

from kvcanary.tap.containment.deployments import DeploymentKeys
from kvcanary.tap.containment.document import QuarantineEntry, QuarantineSet
from kvcanary.tap.containment.watch import QuarantineWatch
from kvcanary.tap.gateway_metrics import gateway_counter
from kvcanary.tap.record import Refusal

log = logging.getLogger("kvcanary.tap")

#: (target, incident) pairs whose observe-mode line was logged, before the memory starts over.
MAX_LOGGED_OBSERVED = 1024


class DeploymentsQuarantined(Exception):
    """Every deployment of a model group is quarantined by kvcanary: the request is refused.

    LiteLLM's proxy answers an error's ``status_code`` with its ``message``; ``num_retries = 0``
    caps its router's retries of this request at none (the same filter would refuse each one)."""

    status_code = 503
    num_retries = 0

    def __init__(self, model_group: str, entries: list[QuarantineEntry], api_bases: list[str] | None = None):
        """``api_bases``: the keys of the deployments kept off, in the group's order."""
        self.model_group = model_group
        self.entries = entries
        self.api_bases = api_bases or []
        self.message = (
            f"model {model_group!r}: every deployment is quarantined by kvcanary "
            f"({'; '.join(entry.describe() for entry in entries)}); no request is sent to a "
            "deployment found leaking until the quarantine is lifted"
        )
        super().__init__(self.message)

    @property
    def kvcanary_refusal(self) -> tuple[str, Refusal]:
        """The deployment the tap's record names (the group's first) and what refused it."""
        first = self.entries[0]
        return (self.api_bases or [""])[0], Refusal("quarantine", incident_id=first.incident_id)


class QuarantineFilter:
    """Narrows a model group's deployments to those not quarantined (module doc)."""

    def __init__(self, watch: QuarantineWatch, count: Callable[[str, str], None] | None = None):
        """``count(target, mode)``: called once per request a target's entry filtered (``enforced``)
        or would have (``observe``); default: the gateway's Prometheus counter, where it has one."""
        self.watch = watch
        self._count = count or gateway_counter(
            "kvcanary_tap_quarantined_requests",
            "Requests kvcanary's quarantine kept off a target's deployments (mode enforced), or would have "
            "(mode observe).",
            ("target", "mode"),
        )
        #: Requests per (target, mode), as ``count`` was told: for tests and a gateway's own views.
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._key_of = DeploymentKeys()
        self._logged_observed: set[tuple[str, int | None]] = set()

    def keep(self, model_group: str, deployments: list[Any]) -> list[Any]:
        """Return ``deployments`` less the quarantined ones (the same list when none is); raise
        :class:`DeploymentsQuarantined` when that leaves none of a list that had some."""
        current = self.watch.snapshot()
        if current.empty:  # the common case: no work per deployment
            return deployments
        return self._narrowed(model_group, deployments, current)

    def _narrowed(self, model_group: str, deployments: list[Any], current: QuarantineSet) -> list[Any]:
        kept: list[Any] = []
        stopped: dict[str, QuarantineEntry] = {}
        stopped_keys: list[str] = []
        watched: dict[str, QuarantineEntry] = {}
        for deployment in deployments:
            key = self._key_of(deployment)
            entry = current.enforced.get(key)
            if entry is not None:
                stopped[entry.target] = entry
                stopped_keys.append(key)
                continue
            if (seen := current.observed.get(key)) is not None:
                watched[seen.target] = seen
            kept.append(deployment)
        for entry in stopped.values():
            self._counted(entry, "enforced")
        for entry in watched.values():
            self._counted(entry, "observe")
            self._log_observed(model_group, entry)
        if stopped and not kept:
            raise DeploymentsQuarantined(model_group, list(stopped.values()), stopped_keys)
        return kept

    def _counted(self, entry: QuarantineEntry, mode: str) -> None:
        self.counts[entry.target, mode] += 1
        self._count(entry.target, mode)

    def _log_observed(self, model_group: str, entry: QuarantineEntry) -> None:
        """Say once per incident what the quarantine would have done, were it enforced."""
        seen = (entry.target, entry.incident_id)
        if seen in self._logged_observed:
            return
        if len(self._logged_observed) >= MAX_LOGGED_OBSERVED:
            self._logged_observed.clear()
        self._logged_observed.add(seen)
        log.warning(
            "kvcanary tap: observe mode: a request to model %r was routed to a deployment quarantined "
            "by kvcanary, %s (enforced, it would have been kept off it)",
            model_group, entry.describe(),
        )  # fmt: skip
