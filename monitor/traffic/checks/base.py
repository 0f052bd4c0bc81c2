"""What a traffic check is: one object in the registry (``checks/__init__.py``) that the judge
(``monitor/traffic/judge.py``) runs on every customer record, in the registry's order.

A check reads one record and what the monitor knows of its deployment (a :class:`CheckContext`)
and returns a :class:`Finding`, or None where it cannot judge (no calibration yet, no pool known,
nothing to compare). Everything after that is the judge's, alike for every check: the counts, the
kept rows, the results of kind ``result_kind`` (source ``traffic``) and the ``check`` label of their
pages. So a new check is one file in this folder, one line in the registry and its test.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from kvcanary.monitor.traffic.distinctive import DistinctiveWindow
from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.monitor.traffic.overlap import OverlapWindow
from kvcanary.probes.base import Certainty, Verdict
from kvcanary.probes.markers import MarkerBook


@dataclass(frozen=True)
class Finding:
    """One check's conclusion on one record.

    ``reason`` is a bounded token, fit for a metric label. ``figures`` are bounded numbers and names:
    the result's evidence names them beside each flagged record, and so does the kept row.
    ``evidence`` is what only the kept row adds on top, under the same keys (the marker check: each
    live marker's id and digests, where its figures count them): a result's evidence stays small.
    """

    check: str
    verdict: Verdict
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def flagged(self) -> bool:
        return self.verdict is not Verdict.PASS


@dataclass(slots=True)
class CheckContext:
    """What a check may read beside the record.

    The batch's part is read once per chunk of records; the record's part (its node, the node's
    KV pool, the prompt's estimated size in tokens) the judge sets before each record's checks: one
    object per chunk rather than one per record, on the judge's hottest path.
    """

    target: str
    markers: MarkerBook
    chars_per_token: float | None
    window: OverlapWindow
    now: float  # monotonic seconds: the overlap window's clock
    min_run: int | None  # None: only the run of another caller's prompt makes a leak
    min_prompt_run: int
    distinctive: DistinctiveWindow
    reworded_min_tokens: int | None  # None: the reworded check is off
    node: str = ""
    pool: int | None = None
    estimate: float | None = None
    #: Whether a check before this one found the record a leak: a window then keeps none of the
    #: answer, which another customer's text must not make look common or public.
    leaked: bool = False


#: The names a check may list in ``needs``.
CONTEXT_FIELDS = frozenset(f.name for f in fields(CheckContext))


class TrafficCheck(ABC):
    """One traffic check. A subclass sets ``name`` (the ``check`` metric and alert label, the kept
    row's key) and ``needs`` (the :class:`CheckContext` fields it reads), and implements
    :meth:`judge`. Made from those, per class: ``result_kind``, the kind its results are stored
    under (``traffic_<name>``, the ``probe`` column, REST field and alert label users already
    have), and ``passed``, its one shared pass (a frozen finding: the hottest path makes none)."""

    name: ClassVar[str]
    needs: ClassVar[frozenset[str]]
    #: Its findings are about a node's KV pool (as a probe's ``judges_pool``): a blast radius then
    #: counts the requests over the pool rather than the flagged records.
    judges_pool: ClassVar[bool] = False
    #: How its failures are known (``probes/base.py``): ``suspected`` where a benign cause can
    #: produce one too (two customers holding the same public text), which then pages and is
    #: verified by probes before anything moves traffic.
    certainty: ClassVar[Certainty] = "certain"
    result_kind: ClassVar[str]
    passed: ClassVar[Finding]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A need the judge does not provide fails when the module is imported, not on the first record.
        unknown = set(cls.needs) - CONTEXT_FIELDS
        if unknown:
            raise TypeError(f"{cls.__name__} needs {sorted(unknown)}, which CheckContext does not hold")
        if "result_kind" not in cls.__dict__:
            cls.result_kind = f"traffic_{cls.name}"
        cls.passed = Finding(cls.name, Verdict.PASS)

    @abstractmethod
    def judge(self, record: TrafficRecord, context: CheckContext) -> Finding | None:
        """Return the finding on ``record``, or None where the check cannot judge it. Never raise:
        a check runs inside the judge's batch, and a raise there costs the whole batch."""

    def __repr__(self) -> str:
        return f"<traffic check {self.name}>"
