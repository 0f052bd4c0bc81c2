"""Probe kinds, registered by name. One file per kind; one explicit line per kind here.

The key is the kind's name in ``targets.yml``, its file name and its ``probe`` metric label.
"""

from __future__ import annotations

from probes.base import Probe
from probes.boundary import BoundaryProbe
from probes.canary import CanaryProbe
from probes.capacity import CapacityProbe
from probes.counters import CountersProbe
from probes.cross_tenant import CrossTenantProbe
from probes.duplicate_ids import DuplicateIdsProbe
from probes.full_batch import FullBatchProbe
from probes.hangup import HangupProbe
from probes.needle import NeedleProbe
from probes.prefix_cache import PrefixCacheProbe
from probes.replay import ReplayProbe
from probes.session import SessionProbe
from probes.shared_prefix import SharedPrefixProbe
from probes.version import VersionProbe

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
}
