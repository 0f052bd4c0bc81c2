"""The overhead benchmark runs end to end on a tiny batch and prints its one-line result last.

Not a timed test: it checks the script works (every healthy request decodes, in lockstep with
shared pools, under every config), not what it measures.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "ownership_overhead.py"


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ownership_overhead", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_it_prints_the_overhead_last_after_decoding_every_request(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench()
    # --threads 0 keeps torch's thread count: the setting is process-wide and would outlive this test.
    argv = ["--rounds", "2", "--steps", "20", "--batch", "3", "--context", "40", "--threads", "0"]
    assert bench.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"ownership verification overhead: -?\d+\.\d\d%", lines[-1])
    assert any(line.startswith("zero-freed/baseline median ratio (A/A control): ") for line in lines)


def test_it_refuses_more_steps_than_the_echo_lasts() -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_bench().parse_args(["--steps", "65", "--context", "64"])
    assert exit_info.value.code == 2
