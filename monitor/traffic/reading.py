"""Reading a body of gateway records: the envelope checked, then each record on its own, so one bad
record is refused, named in the 422, and costs none of the others.

msgspec decodes each good record straight into a :class:`TrafficRecord` (``judged_record.py``);
pydantic (``schema.py``) reads what msgspec refused and names the bad field. How the two are kept
alike and what a refusal may cost: ``docs/architecture.md``, "Gateway traffic".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta
from pydantic import ValidationError
from pydantic_core import from_json

from kvcanary.monitor.traffic.judged_record import (
    RECORD_DECODER,
    TrafficRecord,
    decoded,
    fits,
    from_wire,
    printable,
)
from kvcanary.monitor.traffic.schema import (
    DistinctiveWire,
    FingerprintsWire,
    PromptSizeWire,
    TrafficBatch,
    TrafficRecordWire,
    UsageWire,
    WholeBatch,
    Wire,
    check_version,
)
from kvcanary.probes.untrusted import plain
from kvcanary.wire import MAX_DROPPED, MAX_RECORDS

#: Errors a refused record's 422 names, then those of the whole batch; the rest are counted.
MAX_ERRORS_PER_RECORD = 5
MAX_ERRORS = 50
#: Characters of an error's message, and of each part of its path (a key a client chose), shown.
ERROR_TEXT_CHARS = 200
ERROR_KEY_CHARS = 64


class _Envelope(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A batch as msgspec reads it first: the envelope checked, each record's JSON found and left
    unread (``msgspec.Raw``, a view of the body), to be read one at a time."""

    version: Any = None  # any value read: one not spoken is refused by name (check_version)
    batch: Annotated[str, Meta(pattern=r"^[0-9a-f]{32}\Z")] | None = None
    gateway: Annotated[str, Meta(max_length=64, pattern=r"^[A-Za-z0-9_.:-]*\Z")] = ""
    dropped: Annotated[int, Meta(ge=0, le=MAX_DROPPED)] = 0
    records: Annotated[list[msgspec.Raw], Meta(max_length=MAX_RECORDS)]


class _Versioned(msgspec.Struct):
    """What a body msgspec cannot read as a batch still says: its version and how many records."""

    version: Any = None
    records: list[msgspec.Raw] | None = None


_ENVELOPE = msgspec.json.Decoder(_Envelope)
_VERSIONED = msgspec.json.Decoder(_Versioned)


@dataclass
class ValidRecords:
    records: list[TrafficRecord]
    #: The first errors of the refused records (``bounded_errors``), their ``loc`` starting
    #: ``("records", index)``: at most ``MAX_ERRORS_PER_RECORD`` a record, ``MAX_ERRORS`` in all.
    errors: list[dict[str, Any]]
    refused: int
    #: Errors found and not listed in ``errors`` (a record's unknown keys past the first few are
    #: not looked for, so this is a floor).
    omitted: int = 0


def read_batch(body: bytes, *, versioned: bool = True) -> tuple[TrafficBatch, ValidRecords]:
    """Return the envelope and its valid records, their names printable; raise ValidationError for
    a bad envelope (name it with :func:`bounded_errors`), and :class:`UnspokenVersion` for a body
    whose ``version`` this monitor does not speak (``versioned``: the body says its version, as
    over HTTP; a NATS message's payload does not, its header does).

    msgspec reads the envelope, finding each record's JSON without reading it; then each record is
    read on its own, by msgspec (the common case), else by pydantic, which names what is wrong with
    it. No step reads more than one record at once, so a thread reading a large body lets the event
    loop run between records (a C call holds the GIL for as long as it runs: one call over a body of
    1,000 records with every print a side held it for 177 ms; a record's call takes 0.2 ms). A body
    msgspec cannot read as an envelope, or holding JSON that pydantic reads otherwise, is read whole
    by pydantic."""
    try:
        envelope = _ENVELOPE.decode(body)
    except msgspec.DecodeError:  # malformed, or a bad envelope: pydantic names it
        if versioned:
            _check_version_of_unread(body)
        return _read_by_pydantic(body, versioned=versioned)
    if versioned:
        check_version(envelope.version, len(envelope.records))
    valid = ValidRecords([], [], 0)
    for i, raw in enumerate(envelope.records):
        data = bytes(raw)
        record = decoded(RECORD_DECODER, data)
        if record is not None and fits([record]):
            valid.records.append(printable(record))
            continue
        try:
            parsed = from_json(data)
        except ValueError:  # JSON msgspec took and pydantic does not (a lone surrogate, bad UTF-8)
            return _read_by_pydantic(body, versioned=versioned)
        _validate(valid, i, parsed)
    head = TrafficBatch.model_construct(
        version=envelope.version, batch=envelope.batch, gateway=envelope.gateway, dropped=envelope.dropped,
        records=[],
    )  # fmt: skip
    return head, valid


def _check_version_of_unread(body: bytes) -> None:
    """Raise :class:`UnspokenVersion` for a body msgspec cannot read as a batch but whose version
    it can read, and is not spoken: an old tap's body is refused for its version, whatever else."""
    try:
        found = _VERSIONED.decode(body)
    except msgspec.DecodeError:
        return
    check_version(found.version, len(found.records or ()))


def _read_by_pydantic(body: bytes, *, versioned: bool = True) -> tuple[TrafficBatch, ValidRecords]:
    """Read ``body`` by pydantic alone, whole (what :func:`read_batch` must agree with)."""
    try:
        whole = WholeBatch.model_validate_json(body)
    except ValidationError:
        batch = TrafficBatch.model_validate_json(body)
        if versioned:
            check_version(batch.version, len(batch.records))
        return batch, valid_records(batch)
    if versioned:
        check_version(whole.version, len(whole.records))
    envelope = TrafficBatch.model_construct(
        version=whole.version, batch=whole.batch, gateway=whole.gateway, dropped=whole.dropped, records=[]
    )
    return envelope, ValidRecords([from_wire(r) for r in whole.records], [], 0)


def valid_records(batch: TrafficBatch) -> ValidRecords:
    """Validate each record of ``batch`` on its own: the good ones, and the first few things wrong
    with the rest (``ValidRecords``)."""
    valid = ValidRecords([], [], 0)
    for i, raw in enumerate(batch.records):
        _validate(valid, i, raw)
    return valid


def _validate(valid: ValidRecords, index: int, raw: Any) -> None:
    """Add record ``index`` of a batch (its JSON as Python values) to ``valid``: the record, or its
    first errors, within the bounds of the record and of the batch."""
    try:
        valid.records.append(TrafficRecord.model_validate(_few_unknown_keys(raw, TrafficRecordWire)))
    except ValidationError as exc:
        valid.refused += 1
        room = min(MAX_ERRORS_PER_RECORD, MAX_ERRORS - len(valid.errors))
        kept, left = bounded_errors(exc, ("records", index), room)
        valid.errors += kept
        valid.omitted += left


def bounded_errors(
    exc: ValidationError, prefix: tuple[str | int, ...] = (), room: int = MAX_ERRORS
) -> tuple[list[dict[str, Any]], int]:
    """Return the first ``room`` of ``exc``'s errors as a 422 lists them (type, path under
    ``prefix``, message; never the input, each text bounded), and how many were left out."""
    found = exc.error_count()
    kept = [
        {
            "type": error["type"],
            "loc": (
                *prefix,
                *(part if isinstance(part, int) else plain(part, ERROR_KEY_CHARS) for part in error["loc"]),
            ),
            "msg": plain(error["msg"], ERROR_TEXT_CHARS),
        }
        for error in exc.errors(include_url=False, include_input=False, include_context=False)[: max(room, 0)]
    ]
    return kept, found - len(kept)


#: The objects inside a record, by key, whose unknown keys are trimmed as the record's are.
_NESTED: dict[str, type[Wire]] = {
    "prompt": PromptSizeWire,
    "usage": UsageWire,
    "fingerprints": FingerprintsWire,
    "distinctive": DistinctiveWire,
}


def _few_unknown_keys(raw: Any, model: type[Wire]) -> Any:
    """``raw`` with at most ``MAX_ERRORS_PER_RECORD`` keys ``model`` does not know, here and in its
    nested objects: pydantic names each unknown key, after the known fields and in the order sent,
    so a record of a million unknown keys is refused with the same first errors, at a record's cost."""
    if not isinstance(raw, dict):
        return raw
    known = model.model_fields
    unknown = 0
    trimmed: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            unknown += 1
            if unknown > MAX_ERRORS_PER_RECORD:
                continue
        trimmed[key] = (
            _few_unknown_keys(value, _NESTED[key]) if model is TrafficRecordWire and key in _NESTED else value
        )
    return trimmed
