"""The overlap window (``monitor/traffic/overlap.py``) against the rule recomputed plainly.

The window keeps its maps for speed; the model here keeps only the live exchanges and works out
every answer from them, step by step: who holds a print (in the order they came to hold it, which
names a tie), what is common, what a run is, what a run of what one caller asked is, what expires
by age and by size. Random traffic over a
small set of prints and callers goes through both; every answer must be the same.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from kvcanary.monitor.traffic.overlap import OWN, Overlap, OverlapWindow


@dataclass
class Model:
    window_seconds: float
    max_fingerprints: int
    common_callers: int
    entries: list[tuple[str, float, tuple[int, ...]]] = field(default_factory=list)
    #: Each live entry's prompt prints, beside it.
    asked: list[set[int]] = field(default_factory=list)
    #: Each print's holders in the order they came to hold it (a holder that stops and starts
    #: again comes last).
    order: dict[int, list[str]] = field(default_factory=dict)

    @property
    def held(self) -> int:
        return sum(len(prints) for _, _, prints in self.entries)

    def _sync(self) -> None:
        live: dict[int, set[str]] = {}
        for caller, _, prints in self.entries:
            for f in prints:
                live.setdefault(f, set()).add(caller)
        for f, callers in list(self.order.items()):
            kept = [c for c in callers if c in live.get(f, set())]
            if kept:
                self.order[f] = kept
            else:
                del self.order[f]
        for f, callers in live.items():
            for c in sorted(callers - set(self.order.get(f, []))):  # one new caller a step at most
                self.order.setdefault(f, []).append(c)

    def _expire(self, now: float) -> None:
        while self.entries and (
            self.entries[0][1] < now - self.window_seconds or self.held > self.max_fingerprints
        ):
            self.entries.pop(0)
            self.asked.pop(0)
        self._sync()

    def add(self, caller: str, prints: list[int], now: float, asked: int | None = None) -> None:
        distinct = tuple(dict.fromkeys(f for f in prints if f != OWN))
        if distinct:
            self.entries.append((caller, now, distinct))
            self.asked.append(set(prints if asked is None else prints[:asked]) - {OWN})
            self._sync()
            self._expire(now)

    def longest_run(
        self, caller: str, prompt: list[int], response: list[int], now: float, excused: frozenset[str]
    ) -> Overlap:
        self._expire(now)
        runs: dict[str, int] = {}
        best, best_caller = 0, ""
        for f in response:
            holders = self.order.get(f, [])
            if f == OWN or f in prompt or not holders or len(holders) >= self.common_callers:
                runs = {}
                continue
            runs = {o: runs.get(o, 0) + 1 for o in holders if o != caller and o not in excused}
            for other, run in runs.items():
                if run > best:
                    best, best_caller = run, other
        return Overlap(best, best_caller, len(response))

    def longest_asked_run(
        self, caller: str, prompt: list[int], response: list[int], now: float, excused: frozenset[str]
    ) -> Overlap:
        """The run of prints one other caller alone holds, each sent in the prompt of its latest
        exchange that holds it."""
        self._expire(now)
        run, runner, best, best_caller = 0, "", 0, ""
        for f in response:
            holders = self.order.get(f, [])
            alone = holders[0] if len(holders) == 1 and self.common_callers > 1 else None
            latest = [
                prompt_prints
                for (who, _, prints), prompt_prints in zip(self.entries, self.asked, strict=True)
                if who == alone and f in prints
            ]
            asked = bool(latest) and f in latest[-1]
            if f == OWN or f in prompt or alone is None or alone == caller or alone in excused or not asked:
                run = 0
                continue
            run, runner = (run + 1 if alone == runner else 1), alone
            if run > best:
                best, best_caller = run, alone
        return Overlap(best, best_caller, len(response))

    def holds_all(self, caller: str, prints: list[int]) -> bool:
        distinct = set(prints) - {OWN}
        return bool(distinct) and all(caller in self.order.get(f, []) for f in distinct)


def prints(rng: random.Random, pool: int) -> list[int]:
    start = rng.randrange(pool)
    run = [1 + (start + i) % pool for i in range(rng.randrange(0, 14))]  # text in order
    return [OWN if rng.random() < 0.08 else f for f in run] + rng.sample(range(1, pool + 1), rng.randrange(3))


@pytest.mark.parametrize("seed", range(24))
def test_the_window_answers_as_the_rule_recomputed_from_the_live_exchanges(seed: int) -> None:
    rng = random.Random(seed)
    shape = (rng.choice([5.0, 30.0, 900.0]), rng.choice([20, 60, 400]), rng.choice([1, 2, 3, 4]))
    window, model = OverlapWindow(*shape), Model(*shape)
    callers = [f"c{i}" for i in range(rng.randrange(2, 7))] + [""]
    pool, now = rng.choice([12, 40, 200]), 0.0
    for step in range(400):
        now += rng.choice([0.0, 0.0, 0.5, 3.0, 20.0])
        caller = rng.choice(callers)
        if rng.random() < 0.35 and model.entries:  # a caller sending its own exchange again
            caller, _, sent = rng.choice(model.entries)
            prompt, response = list(sent), prints(rng, pool)
        else:
            prompt, response = prints(rng, pool), prints(rng, pool)
        excused = frozenset(rng.sample(callers, rng.randrange(2)))
        found = window.longest_run(caller, prompt, response, now, excused)
        assert found == model.longest_run(caller, prompt, response, now, excused), step
        found = window.asked.longest_run(caller, prompt, response, now, excused)
        assert found == model.longest_asked_run(caller, prompt, response, now, excused), step
        other = rng.choice(callers)
        assert window.holds_all(other, prompt) == model.holds_all(other, prompt), step
        sent = prompt if rng.random() < 0.2 else [*prompt, *response]
        asked = rng.choice([None, len(prompt), len(prompt), 0, rng.randrange(len(sent) + 1)])
        window.add(caller, sent, now, asked)
        model.add(caller, sent, now, asked)
        assert window.held == model.held, step
        # The prompts' sets made for runs of asked prints go with their exchanges.
        assert window._prompts.keys() <= {entry.serial for entry in window._entries}, step
