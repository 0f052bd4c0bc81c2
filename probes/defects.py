"""Known KV-cache isolation defects by engine version: the data file, versions, and what applies.

The data file is ``probes/data/isolation_defects.yml``; its header is the schema and says how to add
an entry. :func:`load_defects` validates it whole at load (unknown or missing keys, a specifier that
does not parse, an unknown engine, no references, a ``fixed_in`` inside its own range) and raises
:class:`DefectsFileError` naming the entry's id and the key.

Versions are compared as the header describes, with a small PEP 440 subset written here (the
``packaging`` library is only a transitive dependency of the environment, not one of ours):

- numeric release segments, a missing segment being 0 (``0.9 == 0.9.0``, ``0.5.9 < 0.5.22``);
- pre-, post- and dev-releases in PEP 440 order (``1.0.dev1 < 1.0rc1 < 1.0 < 1.0.post1``);
- the local part (``+cpu``) ignored; no epochs, no wildcards, no ``~=``.

A specifier is plain ordering over that key, as OSV ranges are: ``<0.9.0`` contains ``0.9.0rc1``
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

_VERSION_RE = re.compile(
    r"""^v?(?P<release>\d+(?:\.\d+)*)
    (?:[-_.]?(?P<pre_l>alpha|beta|preview|pre|rc|a|b|c)[-_.]?(?P<pre_n>\d+)?)?
    (?:-(?P<post_implicit>\d+)|[-_.]?(?P<post_l>post|rev|r)[-_.]?(?P<post_n>\d+)?)?
    (?:[-_.]?(?P<dev_l>dev)[-_.]?(?P<dev_n>\d+)?)?
    (?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?$""",
    re.VERBOSE | re.IGNORECASE,
)
_PRE_RANK = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}
_LLAMACPP_BUILD_RE = re.compile(r"^b\d+(?:-[0-9a-f]+)?$", re.IGNORECASE)

VersionKey = tuple[tuple[int, ...], tuple[int, int], int, tuple[int, int]]


@functools.total_ordering
@dataclass(frozen=True, eq=False)
class Version:
    """A PEP 440 version (subset); equality and order ignore the local part and trailing zeros."""

    text: str
    release: tuple[int, ...]
    pre: tuple[int, int] | None = None
    post: int | None = None
    dev: int | None = None

    @classmethod
    def parse(cls, text: str) -> Version:
        """Return the version ``text`` names; raise VersionError when it is not one."""
        match = _VERSION_RE.match(text.strip())
        if match is None:
            raise VersionError(f"{text!r} is not a PEP 440 version")
        pre = None
        if match["pre_l"]:
            pre = (_PRE_RANK[match["pre_l"].lower()], int(match["pre_n"] or 0))
        post_text = match["post_implicit"] or match["post_n"]
        post = int(post_text or 0) if (match["post_implicit"] or match["post_l"]) else None
        dev = int(match["dev_n"] or 0) if match["dev_l"] else None
        release = tuple(int(part) for part in match["release"].split("."))
        return cls(text.strip(), release, pre, post, dev)

    @property
    def key(self) -> VersionKey:
        """Return the sort key: PEP 440 order, release zeros trimmed, local part left out."""
        release = self.release
        while len(release) > 1 and release[-1] == 0:
            release = release[:-1]
        if self.pre is not None:
            pre = self.pre
        elif self.post is None and self.dev is not None:
            pre = (-1, 0)  # 1.0.dev1 sorts before 1.0a1
        else:
            pre = (3, 0)  # a final release sorts after its pre-releases
        post = -1 if self.post is None else self.post
        dev = (1, 0) if self.dev is None else (0, self.dev)
        return release, pre, post, dev

    @property
    def local(self) -> bool:
        return "+" in self.text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Version) and self.key == other.key

    def __lt__(self, other: Version) -> bool:
        return self.key < other.key

    def __hash__(self) -> int:
        return hash(self.key)

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
    if not any(version.release):
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


def _twice_given_key(node: Any) -> str | None:
    """Return the first mapping key given twice in a composed YAML tree (plain YAML keeps the last
    one silently), as ``'key' at line N``; None when every key is unique."""
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key, value in node.value:
            if key.value in seen:
                return f"{key.value!r} at line {key.start_mark.line + 1}"
            seen.add(key.value)
            if (found := _twice_given_key(value)) is not None:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            if (found := _twice_given_key(item)) is not None:
                return found
    return None


def load_defects(path: Path = DEFECTS_FILE) -> Catalogue:
    """Return the validated catalogue in ``path``; raise DefectsFileError naming the id and key at fault."""
    try:
        text = path.read_text(encoding="utf-8")
        twice = _twice_given_key(yaml.compose(text, Loader=yaml.SafeLoader))
        raw = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise DefectsFileError(f"{path}: cannot read: {exc}") from None
    if twice is not None:
        raise DefectsFileError(f"{path}: key {twice} is given twice")
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
        problems = []
        for err in exc.errors():
            key = ".".join(str(part) for part in err["loc"])
            message = err["msg"].removeprefix("Value error, ")
            problems.append(f"{key}: {message}" if key else message)
        raise DefectsFileError(f"{path}: {where}: {'; '.join(dict.fromkeys(problems))}") from None


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
