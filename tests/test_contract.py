"""The walls of the house: which package may import which (docs/architecture.md)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.pace import PROCESS_SECONDS

REPO = Path(__file__).resolve().parent.parent


def root_of(module: str) -> str:
    """Return the folder or distribution ``module`` belongs to: ``kvcanary.monitor.app`` is the
    monitor's (every folder imports as ``kvcanary.<folder>``), ``torch.nn`` torch's."""
    return module.removeprefix("kvcanary.").split(".")[0]


def imported_roots(package: str) -> dict[str, set[str]]:
    """Return {file: folders and distributions it imports} for every .py file under ``package``."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / package).rglob("*.py")):
        roots: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                roots |= {root_of(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                roots.add(root_of(node.module))
                if node.module == "kvcanary":  # from kvcanary import monitor
                    roots |= {alias.name for alias in node.names}
        found[str(path.relative_to(REPO))] = roots
    return found


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("workers", {"monitor", "probes"}),  # the worker side stands alone; they meet over HTTP
        ("probes", {"monitor", "workers", "torch", "sqlalchemy", "fastapi", "prometheus_client"}),
        ("monitor", {"workers", "torch"}),  # the monitor installs and runs without torch
    ],
)
def test_packages_import_only_across_allowed_walls(package: str, forbidden: set[str]) -> None:
    offenders = {f: sorted(r & forbidden) for f, r in imported_roots(package).items() if r & forbidden}
    assert offenders == {}


def test_the_monitor_cli_loads_without_torch() -> None:
    code = (
        "import sys, kvcanary.monitor.commands.cli, kvcanary.monitor.app, kvcanary.demo.run, "
        "kvcanary.monitor.commands.check; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=PROCESS_SECONDS)


def documented_metrics(doc: str) -> set[str]:
    """Return the metric names in the first column of a metrics contract's table."""
    import re

    text = (REPO / "docs" / doc).read_text()
    return set(re.findall(r"^\| `(kvcanary_[a-z_]+)` \|", text, flags=re.M))


def test_every_monitor_metric_is_documented_and_every_documented_one_exported() -> None:
    from prometheus_client import CollectorRegistry

    from kvcanary.monitor.metrics.registry import MonitorMetrics
    from kvcanary.monitor.recording.spool import Spool

    metrics = MonitorMetrics(CollectorRegistry())
    metrics.declare("t", {"canary": 30.0})
    metrics.watch_incidents(lambda: [], lambda: [("t", "canary", "")])
    metrics.watch_spool(Spool(None))
    metrics.watch_outbox(lambda: (0, 0.0))
    metrics.declare_alertmanagers(["http://127.0.0.1:9093"])
    metrics.watch_replicas(lambda: (1, 1))
    metrics.watch_slots(lambda: (0, 0, 0, 0))
    report = {"connected": True, "replicas": 1, "partitions": [0], "judged": 0, "duplicates": 0,
              "rejected": 0, "pending_messages": 0, "lag_seconds": 0.0}  # fmt: skip
    metrics.watch_stream(lambda: report)
    metrics.watch_containment(lambda: ["t"], lambda: [])
    metrics.watch_gateways(
        lambda: {"t": {"decode-10.0.0.7-30000": True}}, lambda: {"t": {"decode-10.0.0.7-30000": 0}}
    )
    exported = set()
    for family in metrics.registry.collect():
        exported.add(family.name + ("_total" if family.type == "counter" else ""))
    assert exported == documented_metrics("monitor-metrics.md")


def test_every_document_the_code_cites_exists() -> None:
    """Every path into the repository that a docstring, comment or document cites (``docs/…``,
    ``alerts/…``, a module's file) is there: a moved or never-written file leaves a dead pointer.
    A path in another repository is written ``owner/name:path`` and is not checked."""
    import re

    folders = [
        "docs",
        "alerts",
        "dashboards",
        "probes",
        "monitor",
        "workers",
        "bench",
        "scripts",
        "migrations",
    ]
    cited = re.compile(rf"(?<![\w/.:-])((?:{'|'.join(folders)})/[\w./-]+\.(?:md|py|yml|json|sh))")
    # The project's own files only: a virtual environment's packages cite paths of their own.
    own = [path for folder in (*folders, "tests", "kvcanary") for path in (REPO / folder).rglob("*")]
    own += [path for path in REPO.iterdir() if path.is_file()]
    missing: dict[str, set[str]] = {}
    for path in sorted(own):
        if path.suffix not in {".py", ".md", ".yml", ".toml", ".sh"} or not path.is_file():
            continue
        for name in cited.findall(path.read_text(errors="replace")):
            if not (REPO / name).exists():
                missing.setdefault(name, set()).add(str(path.relative_to(REPO)))
    assert missing == {}
