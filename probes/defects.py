"""Known KV-cache isolation defects by engine version: the data file, versions, and what applies.

The data file is ``probes/data/isolation_defects.yml``; its header is the schema and says how to add
an entry. :func:`load_defects` validates it whole at load (unknown or missing keys, a specifier that
does not parse, an unknown engine, no references, a ``fixed_in`` inside its own range) and raises
:class:`DefectsFileError` naming the entry's id and the key.

Versions are compared as the header describes, parsed and ordered by ``packaging.version``:

- numeric release segments, a missing segment being 0 (``0.9 == 0.9.0``, ``0.5.9 < 0.5.22``);
- pre-, post- and dev-releases in PEP 440 order (``1.0.dev1 < 1.0rc1 < 1.0 < 1.0.post1``);
- this module's own rules: the local part (``+cpu``) ignored, where PEP 440 orders it
  (``0.32.0+cpu`` is the 0.32.0 release), and epochs (``1!2.0``) refused; no wildcards, no ``~=``.

A text ``packaging`` cannot parse (``unknown``, a llama.cpp ``b4567``) is a :class:`VersionError`.

A specifier is plain ordering of those versions, as OSV ranges are: ``<0.9.0`` contains ``0.9.0rc1``
(pip's rule that ``<V`` excludes V's pre-releases is about installing, not about which builds
predate a fix; a release candidate may lack it).

Unknown is never clean. A version that is missing, not a string, does not parse, is an SGLang
source or CI build (``0.0.0.devN+g<sha>``, below every release, so inside every ``<x`` range) or a
llama.cpp ``b<N>-<commit>`` build names no release: :func:`node_version` raises
:class:`VersionError` saying why. A ``requires`` fact the node does not publish makes that entry
``unknown``. A published fact that rules an entry out makes it ``clear`` even if another is missing.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import packaging.version
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from kvcanary.probes.yamlfile import DuplicateKeyError, error_lines, load_yaml

DEFECTS_FILE = Path(__file__).resolve().parent / "data" / "isolation_defects.yml"
#: Engine families an entry may name.
ENGINES = ("sglang", "vllm", "llamacpp")
#: Engine families whose published version this module reads (the reference worker is kvcanary's own).
VERSIONED_ENGINES = (*ENGINES, "reference")
REFERENCE_PREFIX = "kvcanary-reference "
SEVERITY_ORDER = {"critical": 0, "high": 1, "warning": 2}


class DefectsFileError(ValueError):
    """The data file is unreadable or an entry is invalid; the message names the entry and key."""


class VersionError(ValueError):
    """A text names no release this module can compare; the message says why."""


# --- versions --------------------------------------------------------------------------------------

_LLAMACPP_BUILD_RE = re.compile(r"^b\d+(?:-[0-9a-f]+)?$", re.IGNORECASE)


@functools.total_ordering
@dataclass(frozen=True, eq=False)
class Version:
    """A release in PEP 440 order (``packaging``); equality and order ignore the local part.

    ``str()`` is the text as written (``v0.6.3`` stays so in evidence and labels).
    """

    text: str
    #: The version without its local part (``0.32.0`` for ``0.32.0+cpu``): what is compared.
    public: packaging.version.Version

    @classmethod
    def parse(cls, text: str) -> Version:
        """Return the version ``text`` names; raise VersionError when it is not one or has an epoch."""
        try:
            parsed = packaging.version.Version(text.strip())
        except packaging.version.InvalidVersion:
            raise VersionError(f"{text!r} is not a PEP 440 version") from None
        if "!" in text:  # no engine release has an epoch: in an entry or an option it is a mistake
            raise VersionError(f"{text!r} has an epoch (N!): name releases without one")
        return cls(text.strip(), packaging.version.Version(parsed.public))

    @property
    def local(self) -> bool:
        return "+" in self.text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Version) and self.public == other.public

    def __lt__(self, other: Version) -> bool:
        return self.public < other.public

    def __hash__(self) -> int:
        return hash(self.public)

    def __str__(self) -> str:
        return self.text


_OPS: dict[str, Callable[[Version, Version], bool]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
    "!=": operator.ne,
}  # fmt: skip
_CLAUSE_RE = re.compile(r"^\s*(<=|>=|==|!=|<|>)\s*([^\s,]+)\s*$")


@dataclass(frozen=True)
class Specifier:
    """Comma-separated clauses (``>=0.4.0,<0.9.0``) that must all hold."""

    text: str
    clauses: tuple[tuple[str, Version], ...]

    @classmethod
    def parse(cls, text: str) -> Specifier:
        """Return the specifier ``text`` names; raise VersionError naming the clause that is wrong."""
        clauses = []
        for clause in text.split(","):
            match = _CLAUSE_RE.match(clause)
            if match is None:
                wanted = "an operator (<, <=, >, >=, ==, !=) and a release"
                raise VersionError(f"clause {clause.strip()!r} is not {wanted}")
            try:
                version = Version.parse(match[2])
            except VersionError as exc:
                raise VersionError(f"clause {clause.strip()!r}: {exc}") from None
            if version.local:
                raise VersionError(f"clause {clause.strip()!r} names a local build: name releases only")
            clauses.append((match[1], version))
        return cls(text, tuple(clauses))

    def contains(self, version: Version) -> bool:
        return all(_OPS[op](version, bound) for op, bound in self.clauses)


def node_version(engine: str, published: object) -> Version:
    """Return the release that ``engine``'s published version names; raise VersionError saying why
    it names none (missing, not a string, unparseable, a source build, a llama.cpp build number)."""
    if not isinstance(published, str) or not published.strip():
        raise VersionError("not published" if published is None else f"{published!r} is not a string")
    if engine not in VERSIONED_ENGINES:
        raise VersionError(f"{published!r}: engine {engine!r} has no version form this monitor reads")
    text = published.strip()
    if engine == "llamacpp" and _LLAMACPP_BUILD_RE.match(text):
        raise VersionError(f"{text!r} is a llama.cpp build number and commit, not a release")
    if engine == "reference":
        if not text.startswith(REFERENCE_PREFIX):
            raise VersionError(f"{text!r} does not start with {REFERENCE_PREFIX.strip()!r}")
        text = text.removeprefix(REFERENCE_PREFIX)
    version = Version.parse(text)
    if not any(version.public.release):
        raise VersionError(f"{text!r} is a source or CI build (0.0.0.devN): it names no release")
    return version


# --- the data file ---------------------------------------------------------------------------------

FactValue = StrictStr | StrictBool | StrictInt


class Defect(BaseModel):
    """One entry of the data file; every key is required (``fixed_in`` may be null)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: StrictStr = Field(pattern=r"^[a-z0-9]+(?:[-.][a-z0-9]+)*$", max_length=100)
    engine: Literal["sglang", "vllm", "llamacpp"]
    affected: StrictStr
    requires: dict[StrictStr, list[FactValue]]
    fixed_in: StrictStr | None
    severity: Literal["critical", "high", "warning"]
    summary: StrictStr = Field(min_length=1, max_length=300, pattern=r"^[^\n]*$")
    references: list[StrictStr] = Field(min_length=1)

    @field_validator("affected")
    @classmethod
    def _specifier(cls, value: str) -> str:
        Specifier.parse(value)
        return value

    @field_validator("fixed_in")
    @classmethod
    def _release(cls, value: str | None) -> str | None:
        if value is not None:
            Version.parse(value)
        return value

    @field_validator("requires")
    @classmethod
    def _accepted_values(cls, value: dict[str, list[Any]]) -> dict[str, list[Any]]:
        empty = [fact for fact, accepted in value.items() if not accepted]
        if empty:
            raise ValueError(f"{empty} list no accepted value; leave a fact out to accept any")
        return value

    @field_validator("references")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        bad = [url for url in value if not re.match(r"^https://\S+$", url)]
        if bad:
            raise ValueError(f"{bad} are not https URLs")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Defect:
        if not self.id.startswith(f"{self.engine}-"):
            raise ValueError(f"id: must start with its engine ({self.engine}-)")
        if self.fixed_in is not None and self.specifier.contains(Version.parse(self.fixed_in)):
            raise ValueError(f"fixed_in: {self.fixed_in} is inside affected {self.affected!r}")
        return self

    @property
    def specifier(self) -> Specifier:
        return Specifier.parse(self.affected)


@dataclass(frozen=True)
class Catalogue:
    """The validated entries of one data file."""

    defects: tuple[Defect, ...]
    path: Path

    @property
    def ids(self) -> frozenset[str]:
        return frozenset(d.id for d in self.defects)

    def for_engine(self, engine: str) -> list[Defect]:
        """Return the entries naming ``engine``, most severe first."""
        return sorted(
            (d for d in self.defects if d.engine == engine), key=lambda d: SEVERITY_ORDER[d.severity]
        )


def load_defects(path: Path = DEFECTS_FILE) -> Catalogue:
    """Return the validated catalogue in ``path``; raise DefectsFileError naming the id and key at fault."""
    try:
        raw = load_yaml(path.read_text(encoding="utf-8"))
    except DuplicateKeyError as exc:
        raise DefectsFileError(f"{path}: {exc}") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise DefectsFileError(f"{path}: cannot read: {exc}") from None
    if not isinstance(raw, dict) or set(raw) != {"defects"} or not isinstance(raw["defects"], list):
        raise DefectsFileError(f"{path}: must be a mapping with one key, defects: a list of entries")
    defects: list[Defect] = []
    for number, entry in enumerate(raw["defects"], start=1):
        defect = _entry(path, number, entry)
        if defect.id in {d.id for d in defects}:
            raise DefectsFileError(f"{path}: defect {defect.id}: id: given to two entries")
        defects.append(defect)
    return Catalogue(tuple(defects), path)


def _entry(path: Path, number: int, entry: Any) -> Defect:
    name = entry.get("id") if isinstance(entry, dict) else None
    where = f"defect {name}" if isinstance(name, str) else f"defect #{number}"
    try:
        return Defect.model_validate(entry)
    except ValidationError as exc:
        problems = "; ".join(error_lines(exc, dotted_indices=True))
        raise DefectsFileError(f"{path}: {where}: {problems}") from None


@functools.cache
def shipped() -> Catalogue:
    """Return the catalogue shipped with kvcanary, loaded and validated once."""
    return load_defects()


# --- what applies to a node ------------------------------------------------------------------------

Status = Literal["applies", "unknown", "clear"]


@dataclass(frozen=True)
class Finding:
    """One entry judged against one node: ``why`` says what was missing or what ruled it out."""

    defect: Defect
    status: Status
    why: str


def published_fact(facts: Mapping[str, str], name: str) -> str | None:
    """Return the node's fact ``name`` normalised for comparison, or None when it is not published."""
    value = facts.get(name)
    # vLLM writes str(v) for every CacheConfig field: "None" is a field left unset, not a value.
    if value is None or value.strip() in ("", "None"):
        return None
    return _normal(value)


def _normal(value: object) -> str:
    # YAML true and vLLM's "True" are one boolean; SGLang's modes are lower-case words either way.
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value).strip().lower()


def assess(defect: Defect, version: Version, facts: Mapping[str, str]) -> Finding:
    """Return whether ``defect`` applies to a node at ``version`` publishing ``facts``."""
    if not defect.specifier.contains(version):
        return Finding(defect, "clear", f"{version} is outside {defect.affected}")
    missing: list[str] = []
    for fact, accepted in defect.requires.items():
        value = published_fact(facts, fact)
        if value is None:
            missing.append(f"{fact} (needs {' or '.join(str(a) for a in accepted)})")
        elif value not in {_normal(a) for a in accepted}:
            return Finding(defect, "clear", f"{fact} is {facts[fact]}, not {' or '.join(map(str, accepted))}")
    if missing:
        return Finding(defect, "unknown", f"the node does not publish {', '.join(missing)}")
    return Finding(defect, "applies", f"{version} is inside {defect.affected}")


def matching(
    engine: str, version: object, facts: Mapping[str, str], catalogue: Catalogue | None = None
) -> tuple[list[Defect], list[str]]:
    """Return (the defects that apply, why the others could not be judged) for one node.

    ``version`` is what the node published (or a :class:`Version`). An empty second list with an
    empty first means clean; any reason in the second means unknown, never clean.
    """
    try:
        parsed = version if isinstance(version, Version) else node_version(engine, version)
    except VersionError as exc:
        return [], [f"version: {exc}"]
    findings = [assess(d, parsed, facts) for d in (catalogue or shipped()).for_engine(engine)]
    applies = [f.defect for f in findings if f.status == "applies"]
    return applies, [f"{f.defect.id}: {f.why}" for f in findings if f.status == "unknown"]
