"""The bug-zoo benchmark runs end to end on one defect and prints its table.

Not a timed test: it checks the script works (a worker with the defect at a rate is started, the
kind that targets it catches it and the worker's trigger count is read), not what it measures.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bug_zoo.py"


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bug_zoo", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rates_finds_a_defect_firing_on_half_its_triggers(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["rates", "--defects", "abort-in-flight", "--rates", "0.5", "--seeds", "1", "--max-runs", "10"]
    assert load_bench().main(argv) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.match(r"\| `abort-in-flight` \(`hangup`\) \| 0\.5 \| \d+ / \d+ \| 6 \| \d+ / \d+ \|", row), row


def test_an_unknown_defect_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_bench().main(["matrix", "--defects", "no-such-bug"])
    assert exit_info.value.code == 2
    assert "no-such-bug" in capsys.readouterr().err


def test_a_cache_shared_on_purpose_is_judged_as_its_operator_says(capsys: pytest.CaptureFixture[str]) -> None:
    """The shared-prefix workers share their cache across tenants by design: ``prefix_cache`` is told
    ``policy: shared``, as their operator would, so a hit across tenants is a pass, not a leak."""
    argv = ["matrix", "--defects", "prefix-key-partial", "--kinds", "prefix_cache", "--runs", "1"]
    assert load_bench().main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| `prefix_cache`")]
    assert rows == ["| `prefix_cache` | pass 1/1 | pass 1/1 |"], rows
