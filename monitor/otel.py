"""Every verdict as an OpenTelemetry GenAI evaluation event, sent over OTLP/HTTP (opt-in: ``otel:``).

A gateway's telemetry already carries its GenAI spans; kvcanary's verdicts (a probe run's, a traffic
check's) are evaluations of the same serving path, and OpenTelemetry's GenAI semantic conventions
define the event for one: ``gen_ai.evaluation.result``, a log record with that event name and

- ``gen_ai.evaluation.name``: the check, as kvcanary names it (a probe kind, ``canary``; a traffic
  check's result kind, ``traffic_tokens``);
- ``gen_ai.evaluation.score.label``: the verdict, ``pass``, ``leak``, ``mismatch`` or ``error``, and
  ``gen_ai.evaluation.score.value``: 1.0 for ``pass``, 0.0 for ``leak`` and ``mismatch``, none for
  ``error`` (no judgement), which instead sets ``error.type`` to its reason;
- ``gen_ai.evaluation.explanation``: the verdict's reason (``foreign_marker``, ``prompt_tokens_low``);
- ``gen_ai.response.id``: the response judged, where one exists (a flagged traffic record's
  engine response id, which the gateway's own span of it carries);
- kvcanary's own: ``kvcanary.target``, ``kvcanary.node``, ``kvcanary.source`` (probe or traffic),
  ``kvcanary.certainty``, ``kvcanary.incident.id`` and ``kvcanary.result.id`` where recorded.

No body, no detail, no evidence: nothing a customer wrote or was answered, no caller, no key.

:class:`VerdictEvents` takes verdicts from the recording port (``offer``: a bounded queue, never a
wait; a full queue drops the event and counts it in ``kvcanary_otel_events_dropped_total``) and
sends them from a thread of its own, in batches, with the official SDK's logger and OTLP/HTTP
exporter; a batch the collector does not take is counted there too, once the exporter's retries
are spent. The logs SDK is still ``opentelemetry.sdk._logs`` in Python: its public names are used.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import urllib.parse
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from opentelemetry._logs import SeverityNumber
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import (
    InMemoryLogRecordExporter,
    LogRecordExportResult,
    SimpleLogRecordProcessor,
)
from opentelemetry.sdk.resources import Resource
from prometheus_client import Counter

from kvcanary.monitor.config.settings import ConfigError, OtelConfig
from kvcanary.monitor.incidents import RecordOutcome
from kvcanary.monitor.recording.pending import PendingResult
from kvcanary.probes.base import Verdict

log = logging.getLogger(__name__)

EVENT_NAME = "gen_ai.evaluation.result"
SCORES = {Verdict.PASS: 1.0, Verdict.LEAK: 0.0, Verdict.MISMATCH: 0.0}
SEVERITIES = {
    Verdict.PASS: SeverityNumber.INFO,
    Verdict.ERROR: SeverityNumber.WARN,
    Verdict.MISMATCH: SeverityNumber.ERROR,
    Verdict.LEAK: SeverityNumber.ERROR,
}
#: How long stopping waits for the events still queued to be sent.
STOP_SECONDS = 5.0
_Item = tuple[PendingResult, int | None, int | None]


def otlp_headers(config: OtelConfig) -> dict[str, str]:
    """Return the export headers ``headers_env`` or ``headers_file`` hold (``name=value`` pairs, comma
    separated, URL-encoded, as OTEL_EXPORTER_OTLP_HEADERS); raise ConfigError naming the key, never
    a value."""
    if config.headers_env:
        key, text = "otel.headers_env", os.environ.get(config.headers_env)
        if text is None:
            raise ConfigError(f"{key}: the variable {config.headers_env} is not set")
    elif config.headers_file:
        key = "otel.headers_file"
        try:
            text = Path(config.headers_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{key}: cannot read {config.headers_file}: {type(exc).__name__}") from None
    else:
        return {}
    headers: dict[str, str] = {}
    for n, pair in enumerate(p for p in text.replace("\n", ",").split(",") if p.strip()):
        name, sep, value = pair.partition("=")
        name = urllib.parse.unquote(name).strip()
        if not sep or not name or any(c in name for c in " :\r\n"):
            raise ConfigError(f"{key}: entry {n + 1} is not NAME=VALUE")
        headers[name] = urllib.parse.unquote(value).strip()
    return headers


def response_id(item: PendingResult) -> str | None:
    """Return the id of the response judged, where the verdict names one: a traffic result's first
    record's engine response id (else the gateway's id of it). A probe's verdict judges responses
    of its own making and names none."""
    evidence = item.result.evidence
    records = evidence.get("records") if isinstance(evidence, dict) else None
    if not records or not isinstance(records, list) or not isinstance(records[0], dict):
        return None
    found = records[0].get("upstream_id") or records[0].get("request_id")
    return str(found)[:256] if found else None


def event_attributes(item: PendingResult, incident_id: int | None, result_id: int | None) -> dict[str, Any]:
    """Return the ``gen_ai.evaluation.result`` attributes of one verdict (the module's docstring)."""
    result = item.result
    attributes: dict[str, Any] = {
        "gen_ai.evaluation.name": item.kind,
        "gen_ai.evaluation.score.label": result.verdict.value,
        "gen_ai.evaluation.explanation": result.reason,
        "gen_ai.request.model": item.model,
        "kvcanary.target": item.target,
        "kvcanary.node": item.node,
        "kvcanary.source": item.source.value,
        "kvcanary.certainty": result.certainty,
    }
    if result.verdict in SCORES:
        attributes["gen_ai.evaluation.score.value"] = SCORES[result.verdict]
    else:
        attributes["error.type"] = result.reason or "error"
    if (found := response_id(item)) is not None:
        attributes["gen_ai.response.id"] = found
    if incident_id is not None:
        attributes["kvcanary.incident.id"] = incident_id
    if result_id is not None:
        attributes["kvcanary.result.id"] = result_id
    return attributes


class VerdictEvents:
    """Send each verdict offered as a ``gen_ai.evaluation.result`` event, from a thread of its own.

    ``dropped`` is ``kvcanary_otel_events_dropped_total``; ``exporter`` may be given (tests, another
    transport), else the OTLP/HTTP exporter of ``config``.
    """

    def __init__(
        self,
        config: OtelConfig,
        dropped: Counter,
        *,
        headers: Mapping[str, str] | None = None,
        instance: str = "",
        exporter: Any = None,
    ):
        self.config = config
        self._dropped = dropped
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=config.max_queue)
        self._exporter = exporter or OTLPLogExporter(
            endpoint=config.endpoint, headers=dict(headers or {}), timeout=config.timeout_seconds
        )
        # The SDK builds each record (resource, scope, limits); a processor in memory hands them to
        # this thread, which sends them in batches and counts what the collector did not take.
        resource = {
            "service.name": config.service_name,
            "service.version": _version(),
            "service.instance.id": instance or socket.gethostname(),  # a pod's name: one per replica
        }
        self._built = InMemoryLogRecordExporter()  # type: ignore[no-untyped-call]
        self._provider = LoggerProvider(resource=Resource.create(resource), shutdown_on_exit=False)
        self._provider.add_log_record_processor(SimpleLogRecordProcessor(self._built))
        self._logger = self._provider.get_logger("kvcanary", _version())
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def offer(self, item: PendingResult, outcome: RecordOutcome | None = None) -> None:
        """Queue ``item``'s event (with the incident and result ``outcome`` recorded, if any); drop and
        count it when the queue is full. Never waits: the judge and the runner call this."""
        incident = outcome.incident_id if outcome is not None else None
        result = outcome.result_id if outcome is not None else None
        try:
            self._queue.put_nowait((item, incident, result))
        except queue.Full:
            self._dropped.labels("queue_full").inc()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvcanary-otel", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """Send what is queued, within ``timeout``, then stop the thread and the exporter."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._exporter.shutdown()
        self._provider.shutdown()

    def _run(self) -> None:
        while not (self._stopping.is_set() and self._queue.empty()):
            batch = self._take()
            if batch:
                self._send(batch)

    def _take(self) -> list[_Item]:
        """Return up to batch_size items: the first waited for, the rest for at most flush_seconds."""
        try:
            batch = [self._queue.get(timeout=0.2)]
        except queue.Empty:
            return []
        deadline = time.monotonic() + (0 if self._stopping.is_set() else self.config.flush_seconds)
        while len(batch) < self.config.batch_size:
            try:
                batch.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        return batch

    def _send(self, batch: list[_Item]) -> None:
        for item, incident, result in batch:
            self._logger.emit(
                timestamp=int(item.started_at.timestamp() * 1e9),
                severity_number=SEVERITIES[item.result.verdict],
                severity_text=item.result.verdict.value,
                attributes=event_attributes(item, incident, result),
                event_name=EVENT_NAME,
            )
        records = self._built.get_finished_logs()
        self._built.clear()
        try:
            sent = self._exporter.export(records) == LogRecordExportResult.SUCCESS
        except Exception as exc:  # the exporter's own failures must not end the thread
            log.debug("OpenTelemetry export raised %s", type(exc).__name__)
            sent = False
        if not sent:
            self._dropped.labels("export_failed").inc(len(records))
        if sent == self._failing:  # an episode starts or ends: one line each
            self._failing = not sent
            if sent:
                log.info("OpenTelemetry events reach %s again", self.config.endpoint)
            else:
                log.warning("OpenTelemetry events are not taken by %s; dropping and counting them",
                            self.config.endpoint)  # fmt: skip


def _version() -> str:
    try:
        return version("kvcanary")
    except PackageNotFoundError:
        return "0"
