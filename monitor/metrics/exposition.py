"""The per-(target, probe) series, kept in plain dicts and written straight to the text format.

prometheus-client spends about 13 µs per sample formatting an exposition (label names are
re-validated and re-escaped on every scrape) and a lock and a tuple per ``labels()`` call on the
probe path. At 5,000 targets the per-pair series are most of the page: through prometheus-client a
scrape took 3.9 s holding the GIL, stalling every probe meanwhile. Here each pair's label string is
escaped once, at declaration, an observation is a few dict and attribute updates, and a scrape is
one f-string per sample. The same values are also offered to a ``CollectorRegistry`` through
``collect()`` (for ``generate_latest`` and tests); ``tests/monitor/metrics/test_exposition.py`` checks that
both say the same. Format: https://prometheus.io/docs/instrumenting/exposition_formats/
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvcanary.probes.base import Verdict

TOKEN_KINDS = ("prompt", "completion")
VERDICTS = tuple(v.value for v in Verdict)

# (name, type, help, labels beyond target and probe)
RUNS = ("kvcanary_probe_runs_total", "counter", "Probe runs by verdict (pass, leak, mismatch, error).")
TOKENS = (
    "kvcanary_probe_tokens_total",
    "counter",
    "Tokens the probes spent, as the engines reported them in usage.",
)
LAST_RUN = (
    "kvcanary_probe_last_run_timestamp_seconds",
    "gauge",
    "Unix time of the last run, whatever its verdict.",
)
LAST_SUCCESS = (
    "kvcanary_probe_last_success_timestamp_seconds",
    "gauge",
    "Unix time of the last passing run.",
)
INTERVAL = ("kvcanary_probe_interval_seconds", "gauge", "Configured seconds between runs of each probe.")
LAST_DURATION = ("kvcanary_probe_last_duration_seconds", "gauge", "Wall time of the last run of each probe.")
LEAKS = ("kvcanary_cross_tenant_leaks_total", "counter",
         "Probe runs that saw another tenant's live marker in a response.")  # fmt: skip


def escape(value: str) -> str:
    """Escape a label value for the text format."""
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value


def number(value: float) -> str:
    """Write a sample value as prometheus-client does (Go's formatting: ``1.8e+09``, ``+Inf``, ``NaN``)."""
    return str(floatToGoString(value))  # type: ignore[no-untyped-call]


def header(name: str, kind: str, help_: str) -> str:
    # Text format 0.0.4 names a counter's family with its _total, as prometheus-client writes it.
    return f"# HELP {name} {help_}\n# TYPE {name} {kind}\n"


@dataclass(slots=True)
class _Pair:
    labels: str  # probe="..",target=".." escaped once; label names sorted, as prometheus-client writes them
    interval: float
    runs: dict[str, float] = field(default_factory=lambda: dict.fromkeys(VERDICTS, 0.0))
    tokens: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TOKEN_KINDS, 0.0))
    last_run: float = 0.0
    last_success: float = 0.0
    last_duration: float = 0.0


class PairSeries(Collector):
    """Every series labelled by (target, probe), and the per-target leak counter."""

    def __init__(self) -> None:
        self._pairs: dict[tuple[str, str], _Pair] = {}
        self._leaks: dict[str, float] = {}  # by target
        self._target_labels: dict[str, str] = {}  # target -> its escaped name

    def declare(self, target: str, intervals: Mapping[str, float]) -> None:
        """Export zeros for the target's pairs from now on, so ``increase()`` sees the first event."""
        self._leaks.setdefault(target, 0.0)
        for probe, interval in intervals.items():
            pair = self._pair(target, probe)
            pair.interval = float(interval)

    def forget(self, target: str, kinds: Iterable[str] | None = None) -> None:
        """Stop exporting the pairs of ``target`` (only ``kinds``, when given): a reload removed them."""
        for key in [k for k in self._pairs if k[0] == target and (kinds is None or k[1] in kinds)]:
            del self._pairs[key]
        if kinds is None:
            self._leaks.pop(target, None)
            self._target_labels.pop(target, None)

    def observe(
        self,
        target: str,
        probe: str,
        verdict: str,
        duration: float,
        finished_at: float,
        tokens: Mapping[str, float],
    ) -> None:
        pair = self._pair(target, probe)
        pair.runs[verdict] += 1
        pair.last_run = finished_at
        pair.last_duration = duration
        if verdict == "pass":
            pair.last_success = finished_at
        for kind, spent in tokens.items():
            pair.tokens[kind] += spent
        if verdict == "leak":
            self._leaks[target] = self._leaks.get(target, 0.0) + 1

    def _pair(self, target: str, probe: str) -> _Pair:
        pair = self._pairs.get((target, probe))
        if pair is None:
            pair = _Pair(f'probe="{escape(probe)}",target="{escape(target)}"', 0.0)
            self._pairs[(target, probe)] = pair
        return pair

    def _escaped(self, target: str) -> str:
        label = self._target_labels.get(target)
        if label is None:
            label = self._target_labels[target] = escape(target)
        return label

    def render(self) -> str:
        """Return these series in the text exposition format."""
        pairs = list(self._pairs.values())
        out = [header(*RUNS)]
        out += [
            f'{RUNS[0]}{{{p.labels},verdict="{v}"}} {number(n)}\n' for p in pairs for v, n in p.runs.items()
        ]
        out.append(header(*TOKENS))
        out += [
            f'{TOKENS[0]}{{kind="{k}",{p.labels}}} {number(n)}\n' for p in pairs for k, n in p.tokens.items()
        ]
        for family, attribute in ((LAST_RUN, "last_run"), (LAST_SUCCESS, "last_success"),
                                  (INTERVAL, "interval"), (LAST_DURATION, "last_duration")):  # fmt: skip
            out.append(header(*family))
            out += [f"{family[0]}{{{p.labels}}} {number(getattr(p, attribute))}\n" for p in pairs]
        out.append(header(*LEAKS))
        out += [f'{LEAKS[0]}{{target="{self._escaped(t)}"}} {number(n)}\n' for t, n in self._leaks.items()]
        return "".join(out)

    def collect(self) -> Iterator[Metric]:
        items = [((t, p), pair) for (t, p), pair in self._pairs.items()]
        runs = CounterMetricFamily(RUNS[0], RUNS[2], labels=["target", "probe", "verdict"])
        tokens = CounterMetricFamily(TOKENS[0], TOKENS[2], labels=["target", "probe", "kind"])
        for (t, p), pair in items:
            for verdict, n in pair.runs.items():
                runs.add_metric([t, p, verdict], n)
            for kind, n in pair.tokens.items():
                tokens.add_metric([t, p, kind], n)
        yield runs
        yield tokens
        for family, attribute in ((LAST_RUN, "last_run"), (LAST_SUCCESS, "last_success"),
                                  (INTERVAL, "interval"), (LAST_DURATION, "last_duration")):  # fmt: skip
            gauge = GaugeMetricFamily(family[0], family[2], labels=["target", "probe"])
            for (t, p), pair in items:
                gauge.add_metric([t, p], getattr(pair, attribute))
            yield gauge
        leaks = CounterMetricFamily(LEAKS[0], LEAKS[2], labels=["target"])
        for target, n in self._leaks.items():
            leaks.add_metric([target], n)
        yield leaks


def render_gauge(name: str, help_: str, rows: Iterable[tuple[str, float]]) -> str:
    """Return one gauge family whose rows are (escaped label string, value); "" for no labels."""
    lines = (f"{name}{{{labels}}} {number(v)}\n" if labels else f"{name} {number(v)}\n" for labels, v in rows)
    return header(name, "gauge", help_) + "".join(lines)
