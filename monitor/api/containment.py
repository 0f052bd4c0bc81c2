"""The quarantine set: ``GET /api/v1/quarantine`` for the gateways' taps (the ingest token may read
it, and nothing else), signed by the monitors' key and each read counted by the gateway its
``Kvcanary-Gateway`` header names; and a quarantine put on or lifted by hand
(``POST``/``DELETE /api/v1/targets/{name}/quarantine``, the API token). What the rules are:
``monitor/containment/rules.py``; what a tap does with the answer: ``docs/tap-protocol.md``."""

from __future__ import annotations

import asyncio
import re
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, Request, Response, Security, status
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import Field

from kvcanary.monitor.api.deps import NAME_PATTERN, _bearer, require_ingest
from kvcanary.monitor.api.schemas import Problem, _Out
from kvcanary.monitor.api.state import api_state
from kvcanary.monitor.containment import Containment, GuardsUnread, Quarantine, UnknownTarget
from kvcanary.monitor.containment.document import api_bases
from kvcanary.wire import GATEWAY_HEADER, QUARANTINE_HELD_HEADER, QUARANTINE_PAYLOAD_TYPE

set_router = APIRouter(prefix="/api/v1/quarantine", tags=["containment"])
router = APIRouter(prefix="/targets", tags=["containment"])

_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": Problem, "description": "No such target."}}


class QuarantineOut(_Out):
    target: str
    api_bases: list[str] = Field(description="The api_base keys (kvcanary.wire.api_base_key) routed to it.")
    enforced: bool = Field(description="False: the observe policy only records it; gateways route as before.")
    cause: str = Field(description="incident or operator (put on); recovered or operator (lifted).")
    incident_id: int | None
    reason: str
    since: datetime


class Signature(_Out):
    keyid: str = Field(description="kvcanary.wire.key_id of the Ed25519 public key that verifies it.")
    sig: str = Field(description="Base64 Ed25519 signature of envelope_pae(payloadType, payload).")


class SignedSet(_Out):
    """A DSSE envelope: the set's exact bytes and the monitors' signature over them."""

    payloadType: str = Field(QUARANTINE_PAYLOAD_TYPE, description="What the payload is.")
    payload: str = Field(
        description="Base64 of the set's JSON, the bytes signed: version 2, revision, generated_at, "
        "expires_at, deployments and guards (docs/tap-protocol.md, Quarantine)."
    )
    signatures: list[Signature]


class QuarantineBody(_Out):
    reason: str = Field(
        min_length=1, max_length=300, pattern=r"^[^\x00]*$", description="Why, in one line: shown to on-call."
    )


def _containment(request: Request) -> Containment:
    containment = api_state(request).containment
    if containment is None:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "containment is not running here")
    return containment


def _api_bases(request: Request, target: str) -> list[str]:
    return api_bases(api_state(request).settings).get(target, [])


def _out(request: Request, entry: Quarantine) -> QuarantineOut:
    return QuarantineOut(api_bases=_api_bases(request, entry.target), **entry.__dict__)


@set_router.get(
    "",
    summary="The deployments the gateways are to stop sending customers to, signed",
    response_model=SignedSet,
    responses={401: {"model": Problem}, 503: {"model": Problem}},
)
async def quarantine_set(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]
) -> Response:
    """Return the set, signed by the monitors' key (``docs/tap-protocol.md``, "Quarantine"): every
    quarantined target with the api_base keys a tap compares its deployments' with
    (``enforced: false`` entries are the observe policy's: count, do not filter), and the admission
    guard's facts of the guarded targets. The read is counted by the ``Kvcanary-Gateway`` header's
    gateway and the key of the set it says it holds (``Kvcanary-Quarantine-Held: <revision> <key
    id>``, none before its first). 503 where this monitor has no signing key
    (``containment_signing.key_env``), and (with ``Retry-After``) while its admission guards' pools
    were never read: a set without guards would lift every gateway's."""
    require_ingest(request, credentials)
    held = request.headers.get(QUARANTINE_HELD_HEADER, "")
    revision, key = held.split(" ") if re.fullmatch(r"\d{1,19} [0-9a-f]{16}", held) else (None, "")
    gateway = request.headers.get(GATEWAY_HEADER)
    try:
        body = await _containment(request).signed(gateway, key, int(revision) if revision else None)
    except GuardsUnread:  # a tap keeps the set it holds and asks again
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            "the admission guards' pools are not read yet (this replica just started): ask again",
            headers={"Retry-After": "1"},
        ) from None
    if body is None:
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            "no key to sign the quarantine set with: set containment_signing.key_env or key_file",
        )
    return Response(body, media_type="application/json")


Name = Annotated[str, Path(pattern=NAME_PATTERN)]


@router.post(
    "/{name}/quarantine",
    summary="Quarantine a target by hand",
    status_code=status.HTTP_201_CREATED,
    responses={**_NOT_FOUND, 503: {"model": Problem}},
)
async def put_quarantine(request: Request, name: Name, body: QuarantineBody) -> QuarantineOut:
    """Tell every gateway to stop sending customers to ``name`` now (enforced whatever the policy),
    until it is lifted by hand."""
    try:
        entry = await asyncio.to_thread(_containment(request).rules.put, name, body.reason)
    except UnknownTarget:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no target named {name}") from None
    return _out(request, entry)


@router.delete(
    "/{name}/quarantine",
    summary="Lift a target's quarantine by hand",
    responses={**_NOT_FOUND, 503: {"model": Problem}},
)
async def lift_quarantine(
    request: Request,
    name: Name,
    reason: Annotated[str, Query(max_length=300, pattern=r"^[^\x00]*$")] = "lifted by an operator",
) -> QuarantineOut:
    """Lift ``name``'s quarantine; it holds until a new incident (the one that put it on does not
    put it on again). 404 when the target is not quarantined."""
    try:
        entry = await asyncio.to_thread(_containment(request).rules.lift, name, reason[:300])
    except UnknownTarget:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no target named {name}") from None
    if entry is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"{name} is not quarantined")
    return _out(request, entry)
