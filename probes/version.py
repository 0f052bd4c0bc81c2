"""Version: does each node run an engine release with a known KV-cache isolation defect? No requests sent.

Targets the incident's second cause: SGLang before 0.5.22 in disaggregated (PD) mode swapped an
over-capacity request for a one-token placeholder and decoded over stale pages of other requests
(sgl-project/sglang#30233). The disclosure's advice is to confirm the engine version includes the
admission fixes; this probe does it on every node, on a clock, against the known defects in
``probes/data/isolation_defects.yml`` (vLLM's prefix-cache CVEs too), read by ``probes.defects``.

Why the verdict is sound: it compares what the node states about itself (its version and its
configuration facts, see ``monitor/targets/capacity.py``) with entries that each cite their sources.

- A defect whose range holds the node's version and whose required facts all hold is a
  ``mismatch`` (``known_isolation_defect``) naming the defect, the version, the range, the fixed
  release and the first reference; every applicable defect is in the evidence.
- A version the node does not publish, or one that names no release (an SGLang ``0.0.0.devN``
  source build, a llama.cpp ``b<N>-<commit>`` build, a hosted API), and a required fact the node
  does not publish are an ``error`` saying what was missing and where it was looked for; never a
  pass. An operator can state the version (``version``), used only when the node's own says
  nothing: a stale configuration must not hide a published old release.
- Defects the operator accepted (``ignore``) are recorded in the evidence, not judged.
- The check cannot see a backported fix (use ``ignore``) nor a gateway that drops vLLM's
  ``cache_salt`` on a fixed release (the prefix_cache probe's salt check does).
- Whether a PD node checksums its KV hand-offs (SGLang's ``disaggregation_enable_kv_checksum``,
  present in 0.5.23, off by default) is a setting, not a release's defect: the ``capacity`` audit,
  which reads every setting a node states each minute, says it, beside the pool's verdict.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from kvcanary.probes.base import Probe, ProbeContext, ProbeOptions, ProbeResult, Verdict
from kvcanary.probes.defects import (
    VERSIONED_ENGINES,
    Defect,
    DefectsFileError,
    Finding,
    Version,
    VersionError,
    assess,
    node_version,
    shipped,
)
from kvcanary.probes.target import Node, ServerCapacity

#: Where each engine family publishes its version (what ``monitor/targets/capacity.py`` reads).
VERSION_WHERE = {
    "sglang": "`version` in /server_info or /get_server_info",
    "reference": "`version` in /server_info or /get_server_info",
    "vllm": "GET /version",
    "llamacpp": "`build_info` in /props",
    "openai": "nowhere: hosted APIs publish no engine version",
}
#: Where each engine family publishes the facts a defect may require.
FACTS_WHERE = {
    "sglang": "the server arguments in /server_info or /get_server_info",
    "vllm": "the labels of vllm:cache_config_info in /metrics",
    "llamacpp": "/props",
}


class VersionOptions(ProbeOptions):
    # The release the node runs, as the operator knows it, for a node that publishes none.
    version: str | None = Field(None, min_length=1, max_length=64)
    # Defect ids the operator has accepted (a backported fix, a mitigation elsewhere).
    ignore: list[str] = Field(default_factory=list, max_length=100)

    @field_validator("version")
    @classmethod
    def _release(cls, value: str | None) -> str | None:
        if value is not None:
            Version.parse(value)  # a VersionError is a ValueError: the config is refused
        return value

    @field_validator("ignore")
    @classmethod
    def _known_ids(cls, value: list[str]) -> list[str]:
        unknown = sorted(set(value) - shipped().ids)
        if unknown:
            raise ValueError(f"unknown defect id(s) {unknown}; known: {sorted(shipped().ids)}")
        return value


class VersionProbe(Probe):
    """Check a node's engine version and facts against the known isolation defects."""

    kind = "version"
    reaudit_on_config_change = True
    scope = "node"
    options_model = VersionOptions
    default_interval_seconds = 300.0

    async def probe(self, ctx: ProbeContext) -> ProbeResult:
        node = ctx.node or ctx.target.nodes[0]
        engine = ctx.target.engine
        found = await ctx.target.node_capacity(node)
        stated: str | None = ctx.options.get("version")
        ignore: list[str] = list(ctx.options.get("ignore", []))
        evidence = _evidence(node, engine, found, stated, ignore)
        try:
            catalogue = shipped()
        except DefectsFileError as exc:
            return ProbeResult(Verdict.ERROR, "defects_file_invalid", str(exc), evidence)
        version, version_from, why = _resolve(engine, found.version, stated)
        evidence.update(version_from=version_from, published_version_unusable=why or None)
        if version is None:
            detail = f"{engine} version {why}: looked for {_where(engine, node, found)}"
            return ProbeResult(Verdict.ERROR, "version_unknown", detail, evidence)
        if engine not in VERSIONED_ENGINES:
            detail = f"no defect data for engine {engine}: entries are by engine; name the engine behind it"
            return ProbeResult(Verdict.ERROR, "no_defect_data", detail, evidence)
        defects = catalogue.for_engine(engine)
        findings = [assess(d, version, found.facts) for d in defects]
        evidence.update(
            version=str(version),
            checked=[d.id for d in defects],
            facts={fact: found.facts.get(fact) for d in defects for fact in d.requires},
            ignored=[_finding(f) for f in findings if f.defect.id in ignore],
        )
        judged = [f for f in findings if f.defect.id not in ignore]
        return judge_findings(_label(engine, version, version_from), judged, evidence)


def _resolve(engine: str, published: str | None, stated: str | None) -> tuple[Version | None, str, str]:
    """Return (the node's release, ``published`` or ``stated``, why the published one is unusable).

    The node's own version comes first: a stale configuration must not hide a published old release.
    """
    try:
        return node_version(engine, published), "published", ""
    except VersionError as exc:
        why = str(exc)
    if stated is not None:
        return Version.parse(stated), "stated", why
    return None, "", why


def judge_findings(label: str, findings: list[Finding], evidence: dict[str, Any]) -> ProbeResult:
    """Return the verdict on ``findings`` (the entries not ignored) for the node running ``label``.

    Any defect that applies makes a ``mismatch``, even beside entries that could not be judged
    (those stay in the evidence); otherwise any such entry makes an ``error``.
    """
    applies = [f.defect for f in findings if f.status == "applies"]
    unknown = [f for f in findings if f.status == "unknown"]
    evidence.update(defects=[_defect(d) for d in applies], unknown=[_finding(f) for f in unknown])
    measurements = {"known_defects": float(len(applies))}
    if applies:
        first, *others = applies
        fixed = f"fixed in {first.fixed_in}" if first.fixed_in else "no fixed release"
        detail = f"{first.id} applies to {label} (affected {first.affected}, {fixed}; {first.references[0]})"
        if others:
            detail += f", and {len(others)} more: {', '.join(d.id for d in others)}"
        return ProbeResult(Verdict.MISMATCH, "known_isolation_defect", detail, evidence, measurements)
    if unknown:
        where = FACTS_WHERE.get(evidence["engine"], "what the node publishes")
        reasons = "; ".join(f"{f.defect.id} (affected {f.defect.affected}): {f.why}" for f in unknown)
        detail = f"{label} cannot be cleared of {reasons} (looked in {where})"
        return ProbeResult(Verdict.ERROR, "fact_unknown", detail, evidence, measurements)
    accepted = [i["id"] for i in evidence["ignored"] if i["status"] != "clear"]
    if accepted:
        detail = f"{', '.join(accepted)} may apply to {label}; accepted by the operator (ignore)"
        return ProbeResult(Verdict.PASS, "known_defect_accepted", detail, evidence, measurements)
    detail = f"no known defect for {label} ({len(evidence['checked'])} entries checked)"
    return ProbeResult(Verdict.PASS, "no_known_defect", detail, evidence, measurements)


def _label(engine: str, version: Version, version_from: str) -> str:
    label = f"kvcanary-reference {version}" if engine == "reference" else f"{engine} {version}"
    return f"{label} (stated by the operator)" if version_from == "stated" else label


def _where(engine: str, node: Node, found: ServerCapacity) -> str:
    place = VERSION_WHERE.get(engine, "the engine's info endpoints")
    hint = "; state it in options.version" if engine in VERSIONED_ENGINES else ""
    return f"{place} at {node.info_url} (read: {found.source or 'nothing'}){hint}"


def _evidence(
    node: Node, engine: str, found: ServerCapacity, stated: str | None, ignore: list[str]
) -> dict[str, Any]:
    return {
        "node": node.name,
        "role": node.role,
        "engine": engine,
        "version": None,
        "published_version": found.version,
        "stated_version": stated,
        "source": found.source,
        "disaggregation_mode": found.disaggregation_mode,
        "checked": [],
        "facts": {},
        "defects": [],
        "unknown": [],
        "ignore": ignore,
        "ignored": [],
    }


def _defect(defect: Defect) -> dict[str, Any]:
    return {
        "id": defect.id,
        "severity": defect.severity,
        "affected": defect.affected,
        "fixed_in": defect.fixed_in,
        "summary": defect.summary,
        "references": defect.references,
    }


def _finding(finding: Finding) -> dict[str, str]:
    return {"id": finding.defect.id, "status": finding.status, "why": finding.why}
