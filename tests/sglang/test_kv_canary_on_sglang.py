"""SGLang's own KV canary (``--kv-canary log``), running in the real engine, taken in by kvcanary.

The engine is SGLang 0.5.23 on this CPU (``tests/sglang/server.py``), its canary kept running by the
setup script's CPU mend (``scripts/sglang_cpu_canary.py``: three pieces of plumbing; the checks are
SGLang's). Its log is tailed by a real mtail running ``alerts/mtail/sglang_kv_canary.mtail``, whose page
is the node's log page (``log_metrics_port``), read by ``counters`` beside the engine's ``/metrics``.

The fault is SGLang's own: its canary ships a fault injector for its self-test, and
``SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB`` points one position of a running request's block table
at another slot (``srt/kv_canary/perturb/req_to_token.py``): a request reading KV that is not its own,
the failure this project exists for, inside one engine. It starts after
``SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS`` forward steps, so one server is first sound, then faulty:

- sound: the canary logs its stats (steps, protected tokens, no violation), ``counters`` passes with
  the canary's counters read at zero (where without the log page it cannot judge SGLang at all:
  ``test_check_on_sglang.py``);
- faulty: the canary logs violations, mtail counts them, ``counters`` says ``leak``
  (``engine_canary_violations_increased``) for the node, and the deploy gate fails.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes.base import ProbeResult, Verdict
from kvcanary.probes.markers import MarkerBook
from tests.sglang.server import SglangServer, make_model, python_of_a_built_venv, start_server
from tests.support import REPO, stop_process
from tests.support.mtail import Mtail, running_mtail

pytestmark = pytest.mark.xdist_group("sglang")

#: The canary's stats line every 10 forward steps (SGLang's default is 100).
STATS_EVERY_STEPS = 10
#: The engine's running total of violations, as its stats line says it.
ENGINE_TOTAL = "sglang_kv_canary_engine_violations"
#: Forward steps before the injector may act: the server's warm-up and the sound phase's one request
#: (about 15 steps) stay well inside it.
SOUND_STEPS = 60
#: The injector's chance per forward step once it may act.
FAULT_PER_STEP = 0.2
CANARY_ENV = {
    "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": str(STATS_EVERY_STEPS),
    "SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB": str(FAULT_PER_STEP),
    "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": str(SOUND_STEPS),
}
#: One request is ~17 forward steps (a prefill, 16 decodes), a few seconds with the canary on a CPU.
FAULT_TIMEOUT_S = 240.0
READS = "sglang_kv_canary_verify_violations_total"
WRITES = "sglang_kv_canary_write_violations_total"
PERTURBED = re.compile(r"kv_canary perturb req_to_token: req_pool_idx=\d+ position=\d+ original_slot=\d+")


@dataclass(frozen=True)
class Story:
    """What the probe and the engine said while sound, and once the injector had acted."""

    sound: ProbeResult
    sound_samples: dict[str, float]
    faulty: ProbeResult
    faulty_samples: dict[str, float]
    gate_exit: int
    gate_rows: list[dict[str, Any]]
    log: str


def target_config(server: SglangServer, mtail: Mtail) -> dict[str, Any]:
    return {
        "name": "sglang-canary",
        "base_url": server.url,
        "engine": "sglang",
        "model": server.model_name,
        "tenants": [{"name": "tenant-a"}],
        "probes": ["counters"],
        # mtail listens on the engine's host (loopback here): the node's log page by port alone.
        "log_metrics_port": httpx.URL(mtail.url).port,
    }


def read_counters(config: dict[str, Any], state: dict[str, Any] | None = None) -> ProbeResult:
    """One ``counters`` run on the engine's node, as the monitor runs it (state from the last)."""
    target_config = TargetConfig(**config)

    async def go() -> ProbeResult:
        async with OpenAIHttpTarget(target_config, {"tenant-a": None}) as target:
            node = target.nodes[0]
            return (
                await execute_probe("counters", target, MarkerBook(), target_config, node=node, state=state)
            )[0]

    return asyncio.run(go())


def complete(server: SglangServer, words: int) -> None:
    body = {"model": server.model_name, "prompt": "the page table " * words, "max_tokens": 16}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text


def run_gate(folder: Path, config: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """``kvcanary check`` on the target, as an operator would run it: its exit code and rows."""
    path = folder / "kvcanary.yml"
    settings = {"database_url": f"sqlite:///{folder / 'kvcanary.db'}", "targets": [config]}
    path.write_text(json.dumps(settings))  # JSON is YAML
    done = subprocess.run(
        [str(Path(sys.executable).with_name("kvcanary")), "check", "--config", str(path), "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=False,
    )  # fmt: skip
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert rows, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    return done.returncode, rows


def sound_then_faulty(server: SglangServer, mtail: Mtail, folder: Path) -> Story:
    config = target_config(server, mtail)
    # Sound: one request, then the canary's stats line read by mtail, then the node's first read.
    complete(server, 8)
    mtail.until_above("sglang_kv_canary_step", 0, timeout=60)
    sound = read_counters(config)
    sound_samples = mtail.samples()
    assert not PERTURBED.search(server.log_text()), "the injector acted during the sound phase"
    # Faulty: requests until the canary has logged a read violation and its stats line the running
    # total (every 10 steps: the violating request may end before the next), then the next read.
    deadline = time.monotonic() + FAULT_TIMEOUT_S
    words = 8
    while not ((seen := mtail.samples()).get(READS, 0) and seen.get(ENGINE_TOTAL, 0)):
        assert time.monotonic() < deadline, (
            f"no violation logged and totalled in {FAULT_TIMEOUT_S} s:\n{server.log_text()[-3000:]}"
        )
        words += 1  # a new prompt each time, so the radix cache does not answer it whole
        complete(server, words)
    faulty = read_counters(config, sound.state)
    faulty_samples = mtail.samples()
    gate_exit, gate_rows = run_gate(folder, config)
    return Story(sound, sound_samples, faulty, faulty_samples, gate_exit, gate_rows, server.log_text())


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Story]:
    python = python_of_a_built_venv()
    make_model(python)
    folder = tmp_path_factory.mktemp("sglang-canary")
    server, proc, failure = start_server(python, folder, "--kv-canary", "log", env=CANARY_ENV)
    if proc is None:
        pytest.fail(f"SGLang with --kv-canary log did not start.\n{failure}")
    try:
        with running_mtail(server.log_path, folder) as mtail:
            yield sound_then_faulty(server, mtail, folder)
    finally:
        stop_process(proc, timeout=30)


def series(result: ProbeResult, counter: str) -> dict[str, Any]:
    return next(s for s in result.evidence["series"] if s["counter"] == counter)


def engine_total(result: ProbeResult) -> float:
    return next(g["value"] for g in result.evidence["gauges"] if g["gauge"] == "kv_canary_engine_violations")


def test_the_canary_runs_in_the_engine_and_its_stats_reach_mtail(story: Story) -> None:
    assert "install_canary: disaggregation_mode=null config=CanaryConfig(mode=<CanaryMode.LOG" in story.log
    samples = story.sound_samples
    assert samples["sglang_kv_canary_step"] >= STATS_EVERY_STEPS
    assert samples["sglang_kv_canary_protected_tokens"] > 0
    assert samples["sglang_kv_canary_engine_violations"] == 0


def test_while_sound_counters_pass_on_the_canarys_counters_read_at_zero(story: Story) -> None:
    sound = story.sound
    assert (sound.verdict, sound.reason) == (Verdict.PASS, "counters_clean"), sound.detail
    assert sound.evidence["log_metrics"]["read"] is True
    assert series(sound, "engine_canary_violations")["after"] == 0
    assert engine_total(sound) == 0


def test_a_block_table_pointed_at_another_slot_is_a_leak_of_the_node(story: Story) -> None:
    faulty = story.faulty
    assert PERTURBED.search(story.log), "the injector never acted"
    assert (faulty.verdict, faulty.reason) == (Verdict.LEAK, "engine_canary_violations_increased"), (
        faulty.detail
    )
    found = series(faulty, "engine_canary_violations")
    assert found["before"] == 0 and found["increase"] == found["after"] > 0, (found, story.sound.detail)
    assert engine_total(faulty) > 0, faulty.evidence  # the engine's own running total, from its stats line


BY_TAG = re.compile(r'sglang_kv_canary_violations_by_tag_total\{fail_reason="([^"]+)",launch_tag="([^"]+)"')
#: What SGLang 0.5.23 names a failed check (``FailReason``, lower-cased, ``_mismatch`` cut) and where
#: its canary runs (``CanaryLaunchTag``: head, tail or sweep, of K or V, of the full-attention pool).
REASONS = {"verify_chain_hash", "verify_position", "verify_real_kv_hash", "verify_token", "write_token",
           "write_position"}  # fmt: skip
LAUNCH_TAGS = {f"{at}_{kv}_FULL" for at in ("HEAD", "TAIL", "SWEEP") for kv in ("K", "V")}
#: mtail's rule for a write violation: write failures only.
WRITE_ONLY = re.compile(r"write_[a-z_]+(\+write_[a-z_]+)*")


def test_what_mtail_counted_is_what_sglang_logged_by_tag_and_reason(story: Story) -> None:
    by_tag = {(m[2], m[1]): value for key, value in story.faulty_samples.items() if (m := BY_TAG.match(key))}
    assert by_tag, story.faulty_samples
    shown = str(sorted(by_tag.items()))  # whole: a dict's repr in an assertion is cut short
    # The injector points a position of a running request's block table at another slot: every read
    # of it after fails its verify_ checks; a write through it, where one lands after, fails too.
    # Which come first is the machine's pace; that reads go wrong is not.
    assert all(set(reason.split("+")) <= REASONS for _, reason in by_tag), shown
    assert any(reason.startswith("verify_") for _, reason in by_tag), shown
    assert {tag for tag, _ in by_tag} <= LAUNCH_TAGS, shown
    writes = sum(value for (_, reason), value in by_tag.items() if WRITE_ONLY.fullmatch(reason))
    assert story.faulty_samples.get(WRITES, 0) == writes, shown
    assert story.faulty_samples[READS] == sum(by_tag.values()) - writes, shown
    logged = len(re.findall(r"kv_canary violation: launch_tag=", story.log))
    assert logged >= sum(by_tag.values())  # the log ran on while mtail's page was read


def test_the_deploy_gate_fails_on_the_engines_own_finding(story: Story) -> None:
    assert story.gate_exit == 1, story.gate_rows
    [row] = story.gate_rows
    assert (row["verdict"], row["reason"]) == ("leak", "engine_canary_violations_increased"), row
