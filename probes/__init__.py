"""Probe kinds, registered by name. One file per kind; one explicit line per kind here.

The key is the kind's name in ``targets.yml``, its file name and its ``probe`` metric label.
"""

from __future__ import annotations

from kvcanary.probes.base import Probe
from kvcanary.probes.boundary import BoundaryProbe
from kvcanary.probes.canary import CanaryProbe
from kvcanary.probes.capacity import CapacityProbe
from kvcanary.probes.counters import CountersProbe
from kvcanary.probes.cross_tenant import CrossTenantProbe
from kvcanary.probes.duplicate_ids import DuplicateIdsProbe
from kvcanary.probes.full_batch import FullBatchProbe
from kvcanary.probes.hangup import HangupProbe
from kvcanary.probes.needle import NeedleProbe
from kvcanary.probes.prefix_cache import PrefixCacheProbe
from kvcanary.probes.replay import ReplayProbe
from kvcanary.probes.session import SessionProbe
from kvcanary.probes.shared_prefix import SharedPrefixProbe
from kvcanary.probes.slot_reuse import SlotReuseProbe
from kvcanary.probes.version import VersionProbe

REGISTRY: dict[str, type[Probe]] = {
    "canary": CanaryProbe,
    "cross_tenant": CrossTenantProbe,
    "boundary": BoundaryProbe,
    "counters": CountersProbe,
    "capacity": CapacityProbe,
    "version": VersionProbe,
    "needle": NeedleProbe,
    "replay": ReplayProbe,
    "prefix_cache": PrefixCacheProbe,
    "duplicate_ids": DuplicateIdsProbe,
    "shared_prefix": SharedPrefixProbe,
    "hangup": HangupProbe,
    "session": SessionProbe,
    "full_batch": FullBatchProbe,
    "slot_reuse": SlotReuseProbe,
}
