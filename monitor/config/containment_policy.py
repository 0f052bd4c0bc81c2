"""What an open leak does to the gateways' routing: the top-level ``containment:`` policy and a
target's own overrides of it. ``monitor/containment/`` carries it out."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from kvcanary.monitor.config.base import DAY, Strict

Containment = Literal["observe", "quarantine"]


def _off_as_written(value: Any) -> Any:
    """YAML 1.1 reads an unquoted ``off`` as false: take it as the word the operator wrote."""
    return "off" if value is False else value


#: ``off``: the gateways get no admission facts; ``observe``: they count what they would refuse;
#: ``enforce``: they refuse it (``monitor/containment/guards.py``).
AdmissionGuard = Annotated[Literal["off", "observe", "enforce"], BeforeValidator(_off_as_written)]
#: What a ``suspected`` leak (a fingerprint check's, ``probes/base.py``) does: ``page`` (and verify
#: it by probes; an operator's ``confirm`` quarantines) or ``quarantine`` as a certain one does.
Suspected = Literal["page", "quarantine"]


class ContainmentPolicy(Strict):
    """What an open critical leak on a target does to the gateways' routing (``monitor/containment/``):
    ``observe`` records that it would quarantine the target; ``quarantine`` has every gateway's tap
    stop sending customers to it. Set at the top (``containment:``) and, to differ, on a target."""

    mode: Containment = "observe"
    # A quarantine by an incident ends once the incident resolved and the target then went this
    # long without any failure: a deployment that leaks one request in four never gets there.
    lift_after_seconds: float = Field(3600.0, ge=0, le=30 * DAY)
    # Whether the gateways refuse, before any upstream call, a prompt the target's smallest
    # measured KV pool surely cannot hold (the admission check the incident's engine lacked).
    admission_guard: AdmissionGuard = "off"
    # Proof moves traffic, a hint pages: customers sharing a public text must not take a healthy
    # deployment away. ``quarantine`` here is for a target where any hint must close the door.
    suspected: Suspected = "page"


class TargetContainment(Strict):
    """A target's own ``containment:``: what it states replaces the top-level policy's value."""

    mode: Containment | None = None
    lift_after_seconds: float | None = Field(None, ge=0, le=30 * DAY)
    admission_guard: AdmissionGuard | None = None
    suspected: Suspected | None = None
