"""Which cache salt a request runs under: the body's ``cache_salt``, or a trusted gateway's header.

vLLM takes the salt in the body alone, where the client writes it: a client that sends another
tenant's salt joins that tenant's cache domain (vLLM pull request #53347 says the salt must come from
the gateway, not the client). So gateways put it in a header they set for the tenant they
authenticated: NVIDIA Dynamo reads ``x-tenant-id`` before the body's salt, vLLM's pull request #57609
proposes ``X-Cache-Salt``, and in both the header wins, so that no body takes a request out of the
domain its gateway named. ``--cache-salt-header NAME`` makes the worker read one; a header that is
empty or only spaces counts as absent (as Dynamo reads it).

``--bug salt-body-over-header`` (the bug zoo): the body's salt wins where both are sent, as on
Dynamo's native ``/generate`` route (dynamo#14803's review: there "the body wins unconditionally",
so a client posting another tenant's salt is served from, and writes into, that tenant's cache
domain). Its trigger is a request carrying both, naming different salts; with ``--bug-rate`` the
defect acts on a fraction of them, else the header wins, as the fix (the worker without the flag)
always does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the defect's trigger only
    from kvcanary.workers.zoo import BugTrigger


def resolve_salt(header: str | None, body: str | None, *, body_wins: BugTrigger | None = None) -> str | None:
    """Return the salt a request runs under: the header's value (stripped) when it has one, else
    the body's (None: no salt)."""
    stated = header.strip() if header is not None else ""
    if not stated:
        return body
    if body is not None and body != stated and body_wins is not None and body_wins.fires():
        return body  # THE DEFECT: the client's body overrides the gateway's header
    return stated
