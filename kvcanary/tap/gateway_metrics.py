"""Counters in the gateway's own metrics: prometheus-client's where the gateway has it (LiteLLM's
proxy does), none where it does not. One counter per process however many taps are built, since a
second registration of a name raises."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def gateway_counter(name: str, documentation: str, labels: tuple[str, ...] = ()) -> Callable[..., None]:
    """Return ``count(*label_values, by=1)`` adding to the counter ``name`` (``_total``), or a no-op
    without prometheus-client."""
    try:
        from prometheus_client import REGISTRY, Counter
    except ImportError:
        return lambda *values, by=1: None
    existing = REGISTRY._names_to_collectors.get(f"{name}_total")
    counter: Any = existing or Counter(name, documentation, list(labels))
    if not labels:
        return lambda by=1: counter.inc(by)
    return lambda *values, by=1: counter.labels(*values).inc(by)


def gateway_gauge(name: str, documentation: str, read: Callable[[], float]) -> bool:
    """Export ``read()`` as the gauge ``name``, read at each scrape (the latest caller's function where
    several register one name); False without prometheus-client."""
    try:
        from prometheus_client import REGISTRY, Gauge
    except ImportError:
        return False
    gauge: Any = REGISTRY._names_to_collectors.get(name) or Gauge(name, documentation)
    gauge.set_function(read)
    return True
