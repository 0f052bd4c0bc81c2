"""The built wheel installs and runs on its own, and claims no generic top-level name (issue 10).

The repository keeps ``monitor/``, ``probes/``, ``workers/``, ``migrations/``, ``alerts/`` and
``dashboards/`` at the top; the wheel installs them under ``kvcanary`` with their imports rewritten
by ``setup.py``. The rewrite is tested on its own first (fast). The slow tests build the wheel
from a copy of the working tree, install it into a fresh venv (dependencies from a wheelhouse
cached in ``~/.cache/kvcanary/``, built once from the configured indexes; no torch), and run the
console script from an empty folder: migrate SQLite, serve, answer, stop on SIGTERM.
"""

from __future__ import annotations

import ast
import contextlib
import email
import hashlib
import importlib.util
import os
import platform
import shutil
import signal
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from tests.conftest import REPO, free_port, wait_http

ROOTS = ("monitor", "probes", "workers", "migrations", "alerts", "dashboards")
Rewrite = Callable[[str], str]


def load_setup() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvcanary_setup", REPO / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # setup() itself runs only as a script
    return module


# --- the import rewrite ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def namespaced() -> Rewrite:
    rewrite: Rewrite = load_setup().namespaced
    return rewrite


def test_it_moves_from_imports_under_kvcanary_keeping_the_statement_as_written(namespaced: Rewrite) -> None:
    source = textwrap.dedent(
        """\
        from monitor.config.settings import (  # the settings
            Settings,
            load_settings as load,
        )
        from probes import REGISTRY
        from dashboards import overview, workers
        """
    )
    assert namespaced(source) == textwrap.dedent(
        """\
        from kvcanary.monitor.config.settings import (  # the settings
            Settings,
            load_settings as load,
        )
        from kvcanary.probes import REGISTRY
        from kvcanary.dashboards import overview, workers
        """
    )


def test_it_rewrites_plain_imports_so_that_they_bind_the_same_names(namespaced: Rewrite) -> None:
    source = textwrap.dedent(
        """\
        import monitor
        import monitor as m
        import monitor.storage.db as db
        import os, workers.cli, json
        def f():
            import probes.base
            return probes.base
        """
    )
    assert namespaced(source) == textwrap.dedent(
        """\
        from kvcanary import monitor
        from kvcanary import monitor as m
        import kvcanary.monitor.storage.db as db
        import os; import kvcanary.workers.cli; from kvcanary import workers; import json
        def f():
            import kvcanary.probes.base; from kvcanary import probes
            return probes.base
        """
    )


def test_it_leaves_strings_comments_relative_imports_and_other_modules_alone(namespaced: Rewrite) -> None:
    source = textwrap.dedent(
        '''\
        """Run ``python -m workers``; see monitor.commands.cli."""
        # from monitor import x
        import monitoring
        from monitoring.probes import y
        from . import monitor
        from .workers import z
        patch = "monitor.runs.runner.run"
        def g():
            raise ValueError("x") from monitor
        def h():
            yield from workers
        '''
    )
    assert namespaced(source) == source


def test_it_counts_columns_in_characters_after_non_ascii_text(namespaced: Rewrite) -> None:
    source = 'label = "état"; import monitor  # é\nü = 1; from probes.base import Verdict\n'
    assert namespaced(source) == (
        'label = "état"; from kvcanary import monitor  # é\nü = 1; from kvcanary.probes.base import Verdict\n'
    )


def test_it_refuses_an_import_it_cannot_rewrite_on_its_own_lines(namespaced: Rewrite) -> None:
    with pytest.raises(ValueError, match="line 1"):
        namespaced("import os, \\\n    monitor\n")


def test_every_repository_module_keeps_its_lines_and_loses_every_generic_import(namespaced: Rewrite) -> None:
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            source = path.read_text(encoding="utf-8")
            rewritten = namespaced(source)
            assert rewritten.count("\n") == source.count("\n"), path
            assert generic_imports(rewritten) == [], path
            assert namespaced(rewritten) == rewritten, path  # idempotent: a rebuild changes nothing


def generic_imports(source: str) -> list[str]:
    """Return the modules under ``ROOTS`` that ``source`` imports by their top-level name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.partition(".")[0] in ROOTS]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [node.module] if node.module.partition(".")[0] in ROOTS else []
    return found


# --- the wheel ------------------------------------------------------------------------------------------


def run(argv: list[str | Path], *, timeout: float = 300, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, (
        f"{result.args} exited {result.returncode}:\n{result.stdout}{result.stderr}"
    )
    return result


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Return a copy of the working tree's tracked and new files: no build/ or egg-info left over."""
    copy = tmp_path_factory.mktemp("source")
    listed = ok(run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO))
    for name in filter(None, listed.stdout.split("\0")):
        if (REPO / name).is_file():  # a tracked file deleted in the working tree is not built
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
    return copy


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the wheel from ``source`` as ``pip install .`` builds it."""
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: this venv's setuptools builds it, so the build needs no index.
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    ok(run([*pip, "-w", out, source]))
    (built,) = out.glob("kvcanary-*.whl")
    return built


@pytest.mark.slow
def test_the_wheel_holds_only_the_kvcanary_package_with_its_data(source: Path, wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = next(n.partition("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        top_level = zf.read(f"{info}/top_level.txt").decode().split()
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
        sources = {n: zf.read(n).decode() for n in names if n.endswith(".py")}
    assert {n.partition("/")[0] for n in names} == {"kvcanary", info}
    assert top_level == ["kvcanary"]
    assert "kvcanary = kvcanary.cli:main" in entry_points
    expected = {"kvcanary/__init__.py", "kvcanary/cli.py", "kvcanary/py.typed"}
    for root in ROOTS:
        for path in (source / root).rglob("*"):
            relative = path.relative_to(source).as_posix()
            if path.suffix in (".py", ".md", ".json", ".mako", ".yml") and "/tests/" not in f"/{relative}":
                expected.add(f"kvcanary/{relative}")
    assert expected - names == set()
    for must in (
        "kvcanary/migrations/env.py",
        "kvcanary/alerts/runbooks/KVCanaryLeak.md",
        "kvcanary/alerts/kvcanary.rules.yml",
        "kvcanary/dashboards/kvcanary-overview.json",
        "kvcanary/dashboards/provisioning/dashboards.yml",
        "kvcanary/probes/data/isolation_defects.yml",
    ):
        assert must in names
    assert not any(n.endswith((".pyc", ".db")) or "/__pycache__/" in n for n in names)
    assert {n: generic_imports(s) for n, s in sources.items() if generic_imports(s)} == {}
    assert "from kvcanary.monitor.commands.cli import main" in sources["kvcanary/cli.py"]


def wheelhouse(wheel: Path, python: Path) -> Path:
    """Return a folder of wheels for ``wheel``'s dependencies, built once per dependency list."""
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = sorted(email.message_from_string(metadata).get_all("Requires-Dist") or [])
    platform_ = [sys.version, sys.platform, platform.machine()]
    key = hashlib.sha256("\n".join([*platform_, *requires]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvcanary"
    house = cache / f"wheelhouse-{key}"
    if not house.is_dir():
        partial = cache / f".wheelhouse-{key}-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        ok(run([python, "-m", "pip", "wheel", "-q", "-w", partial, wheel], timeout=900))
        for own in partial.glob("kvcanary-*.whl"):
            own.unlink()
        with contextlib.suppress(OSError):  # another session filled it first
            partial.rename(house)
        shutil.rmtree(partial, ignore_errors=True)
    return house


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Return the bin folder of a fresh venv with the wheel installed (without torch)."""
    root = tmp_path_factory.mktemp("venv")
    ok(run([sys.executable, "-m", "venv", root]))
    python = root / "bin" / "python"
    house = wheelhouse(wheel, python)
    ok(run([python, "-m", "pip", "install", "-q", "--no-index", "--find-links", house, wheel]))
    return root / "bin"


@pytest.fixture
def empty_dir(tmp_path: Path) -> Path:
    where = tmp_path / "empty"
    where.mkdir()
    return where


def clean_env() -> dict[str, str]:
    """This environment without anything that would put the source tree on ``sys.path``."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


@pytest.mark.slow
def test_the_installed_package_imports_only_under_kvcanary_and_finds_its_data(
    venv: Path, empty_dir: Path
) -> None:
    where = ok(run([venv / "python", "-c", "import site; print(site.getsitepackages()[0])"]))
    site = Path(where.stdout.strip())
    assert sorted(name for name in (*ROOTS, "tests", "bench", "kvcanary") if (site / name).exists()) == [
        "kvcanary"
    ]
    missing = run([venv / "python", "-c", "import monitor"], cwd=empty_dir, env=clean_env())
    assert missing.returncode == 1 and "No module named 'monitor'" in missing.stderr
    check = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        import kvcanary.monitor, kvcanary.monitor.commands.cli, kvcanary.probes
        import kvcanary.monitor.commands.demo
        from kvcanary.monitor.storage.db import MIGRATIONS_DIR, head_revision
        from kvcanary.monitor.api.runbooks import RUNBOOKS_DIR
        from kvcanary.monitor.commands.demo_stack import RULES
        from kvcanary.monitor.commands.dashboards import dashboard_files
        from kvcanary.probes.defects import DEFECTS_FILE, load_defects
        package = Path(kvcanary.__file__).parent
        assert package == Path({str(site)!r}) / "kvcanary", package
        for path in (MIGRATIONS_DIR / "env.py", RUNBOOKS_DIR / "KVCanaryLeak.md", RULES, DEFECTS_FILE):
            assert path.is_file() and path.is_relative_to(package), path
        assert [p.name for p in dashboard_files()] == ["kvcanary-overview.json", "kvcanary-workers.json"]
        assert load_defects() and head_revision()
        assert kvcanary.monitor.commands.cli.WORKERS_MODULE == "kvcanary.workers"
        assert kvcanary.monitor.commands.demo.WORKERS_MODULE == "kvcanary.workers"
        assert not {{"monitor", "probes", "workers", "torch"}} & set(sys.modules), sorted(sys.modules)
        """
    )
    ok(run([venv / "python", "-c", check], cwd=empty_dir, env=clean_env()))


@pytest.mark.slow
def test_the_console_script_migrates_serves_and_stops_without_a_source_tree(
    venv: Path, empty_dir: Path
) -> None:
    env = clean_env()
    kvcanary = venv / "kvcanary"
    assert "--json" in ok(run([kvcanary, "check", "--help"], cwd=empty_dir, env=env)).stdout
    # `kvcanary worker` execs `python -m kvcanary.workers`, whose --help needs no torch.
    assert "--kv-pool-tokens" in ok(run([kvcanary, "worker", "--help"], cwd=empty_dir, env=env)).stdout

    port, nobody = free_port(), free_port()
    token = empty_dir / "api-token"
    token.write_text("t" * 40)
    for tenant in ("a", "b"):
        (empty_dir / f"key-{tenant}").write_text(f"key-{tenant}")
    config = empty_dir / "kvcanary.yml"
    config.write_text(
        textwrap.dedent(
            f"""\
            database_url: sqlite:///{empty_dir / "kvcanary.db"}
            api: {{listen: "127.0.0.1:{port}", token_file: {token}}}
            spool: {{in_memory: true}}
            alertmanagers: []
            targets:
              - name: nowhere
                base_url: http://127.0.0.1:{nobody}
                engine: reference
                model: kvcanary-reference
                tenants:
                  - {{name: a, api_key_file: {empty_dir / "key-a"}}}
                  - {{name: b, api_key_file: {empty_dir / "key-b"}}}
                interval_seconds: 5
                probes: [canary]
            """
        )
    )
    migrated = ok(run([kvcanary, "db", "upgrade", "--config", config], cwd=empty_dir, env=env))
    assert "database migrated to head" in migrated.stdout

    log = (empty_dir / "serve.log").open("wb")
    proc = subprocess.Popen(
        [kvcanary, "serve", "--config", config], cwd=empty_dir, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/healthz", timeout=60, proc=proc)
        docs = httpx.get(f"{base}/docs", timeout=5)
        assert docs.status_code == 200 and "/docs/static/swagger-ui-bundle.js" in docs.text
        assert httpx.get(f"{base}/docs/static/swagger-ui-bundle.js", timeout=5).status_code == 200
        runbook = httpx.get(f"{base}/runbooks/KVCanaryLeak", timeout=5)
        assert runbook.status_code == 200 and "KVCanaryLeak" in runbook.text
        metrics = httpx.get(f"{base}/metrics", timeout=5)
        assert metrics.status_code == 200 and "kvcanary_database_up 1.0" in metrics.text
        bearer = {"Authorization": f"Bearer {token.read_text()}"}
        targets = httpx.get(f"{base}/api/v1/targets", headers=bearer, timeout=5)
        assert targets.status_code == 200 and "nowhere" in targets.text
        proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal after its graceful shutdown.
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        served = (empty_dir / "serve.log").read_text()
        assert "kvcanary stopped cleanly" in served and "Traceback" not in served, served[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()


@pytest.mark.slow
def test_migrating_in_process_leaves_the_generic_names_unimportable(venv: Path, empty_dir: Path) -> None:
    check = textwrap.dedent(
        f"""
        import importlib.util
        from kvcanary.monitor.storage.db import upgrade
        upgrade("sqlite:///{empty_dir / "kvcanary.db"}")
        found = [n for n in ("monitor", "probes", "workers") if importlib.util.find_spec(n)]
        assert not found, f"importable after a migration: {{found}}"
        """
    )
    ok(run([venv / "python", "-c", check], cwd=empty_dir, env=clean_env()))
