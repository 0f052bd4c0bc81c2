"""The README's main command: the demo catches the leak and keeps the healthy target green, and,
with a LiteLLM venv set up, prints the incident's blast radius in the customers' traffic."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from kvcanary.demo.gateway import litellm_venv
from kvcanary.demo.printer import DemoPrinter
from kvcanary.demo.run import INTERVALS
from kvcanary.monitor.runs.runner import RunSummary
from kvcanary.probes.base import ProbeResult, Verdict
from tests.support import REPO, free_port
from tests.support.pace import PROCESS_SECONDS


@pytest.mark.slow
def test_the_demo_catches_the_leak_and_shows_redacted_evidence(tmp_path: Path) -> None:
    """Run as the README says: everything shown, then Ctrl-C; the demo stops in order, with its
    closing line and no traceback."""
    log = tmp_path / "demo.out"
    # --duration: an upper bound; Ctrl-C ends it once all is shown.
    argv = [sys.executable, "-m", "monitor", "demo", "--port", str(free_port()), "--workdir", str(tmp_path),
            "--duration", "240"]  # fmt: skip
    with log.open("w") as out:
        demo = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 240
        while "Ctrl-C to stop." not in log.read_text() and demo.poll() is None:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        demo.send_signal(signal.SIGINT)
        demo.wait(timeout=PROCESS_SECONDS)
    finally:
        if demo.poll() is None:
            demo.kill()
    out = log.read_text()
    assert demo.returncode == 0, out
    assert "LEAK CAUGHT on target 'defective'" in out
    assert "incident  : #" in out and "critical" in out
    assert "<redacted>" in out, "the excerpt must show the marker redacted"
    assert "healthy target is green" in out
    closing = "=== demo: exit 0: the leak caught and paged; the healthy target green to the end ==="
    assert out.rstrip().endswith(closing), out[-2000:]
    assert "Traceback" not in out, out[-3000:]
    # The page: the monitor's own push, and Prometheus's rule on the same leak, in a real Alertmanager.
    assert "=== PAGED: KVCanaryLeak (critical) on defective/" in out
    assert "Prometheus's rule KVCanaryLeakDetected fired on the same leak" in out
    assert "/#/alerts" in out
    keys = [(tmp_path / f"key-{t}").read_text() for t in ("tenant-a", "tenant-b")]
    assert all(k not in out for k in keys)
    # The quarantine set's signing key, made in the workdir: its private half is never shown.
    private = (tmp_path / "quarantine-signing.key").read_text().splitlines()[1]
    assert private not in out and (tmp_path / "quarantine-signing.pub").exists()
    # Containment under the demo's observe policy: recorded and said by the gateway, then turned on.
    assert "=== CONTAINMENT: defective would have quarantined (containment.mode: observe)" in out
    if litellm_venv() is not None:  # the gateway ran: the blast radius matches the customers' count
        assert_blast_radius(out)
        said = [line for line in out.splitlines() if line.startswith("  gateway   : observe mode")]
        assert any("quarantined by kvcanary, target 'defective'" in line for line in said), out[-3000:]
        assert any("whose smallest KV pool is 2048 tokens" in line for line in said), out[-3000:]
        assert_contained(out)
        signed = r"  signed    : with key [0-9a-f]{16} .*, checked by the gateway's public key: [1-9]\d* "
        assert re.search(signed, out), out[-3000:]


def summary(target: str, kind: str, verdict: Verdict) -> RunSummary:
    result = ProbeResult(verdict, "foreign_marker" if verdict is Verdict.LEAK else "ok")
    return RunSummary(target, kind, "", result, datetime.now(UTC), 0.1, None)


def test_the_demo_exits_0_only_when_its_closing_line_says_green_throughout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    printer = DemoPrinter(INTERVALS)
    printer(summary("defective", "boundary", Verdict.LEAK))
    for kind in INTERVALS:
        printer(summary("healthy", kind, Verdict.PASS))
    assert printer.closing(paged=True) == (
        0,
        "=== demo: exit 0: the leak caught and paged; the healthy target green to the end ===",
    )
    assert printer.closing(paged=False)[0] == 1
    unpaged = printer.closing(paged=None)  # no Alertmanager here: green, and not said to be paged
    assert unpaged[0] == 0 and "the leak caught (no Alertmanager here: not paged)" in unpaged[1]
    # A false alarm on the healthy target fails the demo though later passes hide it from the last
    # verdicts; an error at the end fails it too, and the line says which verdict did.
    printer(summary("healthy", "canary", Verdict.LEAK))
    printer(summary("healthy", "canary", Verdict.PASS))
    code, line = printer.closing(paged=True)
    assert code == 1 and "the healthy target was judged canary leak (foreign_marker)" in line, line
    printer.false_alarms.clear()
    printer(summary("healthy", "counters", Verdict.ERROR))
    code, line = printer.closing(paged=True)
    assert code == 1 and "last verdicts were not all pass" in line and "counters error" in line, line
    assert "canary pass" in line
    capsys.readouterr()


def assert_contained(out: str) -> None:
    """Then containment on for the defective target: the gateway takes it up, no later customer
    request is answered by the defective worker, and the blast radius stops growing."""
    section = out[out.index("=== CONTAINMENT ON for 'defective'") :]
    assert "quarantine: defective since" in section and "enforced" in section, section
    assert "guard     : prompts over 2048 tokens kept off 'defective'" in section, section
    taken = re.search(r"gateway   : took it up ([\d.]+)s after the reload", section)
    assert taken is not None and float(taken.group(1)) < 3.0, section
    customers = re.search(r"customers : .*", section).group(0)  # type: ignore[union-attr]
    assert "answered by healthy" in customers and "defective" not in customers, customers
    assert "exposed   : 0 more over-pool answers from 'defective' after containment" in section
    radius = r"blast radius of incident #\d+: (\d+) response\(s\) now, (\d+) before"
    now, before = re.search(radius, section).groups()  # type: ignore[union-attr]
    assert now == before and int(now) > 0, section


def assert_blast_radius(out: str) -> None:
    section = out[out.index("=== BLAST RADIUS of incident #") :]
    section = section[: section.index("page      :")]
    affected = int(re.search(r"affected  : (\d+) response", section).group(1))  # type: ignore[union-attr]
    truth = re.search(r"answered 200: (.*) \(\d+ sent\)", section).group(1)  # type: ignore[union-attr]
    counted = {m[0]: int(m[1]) for m in re.findall(r"(\w+) (\d+)", truth)}
    assert affected == sum(counted.values()) > 0, section
    for caller, n in counted.items():
        assert re.search(rf"\n  {caller}\s*: {n} \(first", section), section


def test_sigterm_to_the_demo_stops_its_workers(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "monitor", "demo", "--port", str(free_port()), "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # wait until both workers are up and the monitor is serving
        lines.append(line)
        if line.strip().startswith("monitor "):
            break
    worker_pids = workers_of(tmp_path)
    assert len(worker_pids) == 2, "".join(lines)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=PROCESS_SECONDS)
    assert proc.returncode == 128 + signal.SIGTERM  # stopped as a service manager expects
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(pid) for pid in worker_pids):
        time.sleep(0.2)
    assert not any(alive(pid) for pid in worker_pids), "the demo left its workers running"


def workers_of(workdir: Path) -> list[int]:
    """PIDs of the `python -m kvcanary.workers` processes whose command line names ``workdir``."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kvcanary.workers" in argv and any(str(workdir).encode() in a for a in argv):
            pids.append(int(cmdline.parent.name))
    return pids


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.split(") ", 1)[1][0] != "Z"  # a zombie has exited; it only awaits its reaper
