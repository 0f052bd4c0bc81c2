"""Read a serving node's Prometheus page into plain numbers, with prometheus-client's parser.

Probes judge counters but never parse exposition text themselves (they import no metrics library):
:func:`parse_samples` turns a page into ``{sample name: value summed over labels}``, and keeps each
labelled series too under ``name{labels}`` (a counter's increase is taken series by series: one
data-parallel engine restarting must not look like the whole node starting again). ``_info``
samples are kept by series only, since their labels carry a node's configuration.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def parse_samples(text: str) -> dict[str, float]:
    """Return every sample of ``text`` summed over its labels; raise ValueError on a page that does
    not parse (the parser's own assorted errors are folded into it)."""
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name, value = sample.name, float(sample.value)
                if sample.labels:
                    labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                    out[f"{name}{{{labels}}}"] = value
                    if name.endswith("_info"):
                        continue
                out[name] = out.get(name, 0.0) + value
    except Exception as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}"[:300]) from None
    return out
