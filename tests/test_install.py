"""The package a user installs is the code the tests run, and it claims no generic top-level name.

The repository keeps ``monitor/``, ``probes/``, ``workers/``, ``migrations/``, ``alerts/`` and
``dashboards/`` at the top, and ``kvcanary/<folder>`` is a link to each: a checkout, an editable
install and the wheel import the same names (``kvcanary.monitor``, ...), and the wheel's files are
the repository's, byte for byte, with nothing rewritten at build time. The fast tests hold the
checkout to that; the slow ones build the wheel from a copy of the working tree, install it into a
fresh venv (dependencies from a wheelhouse cached in ``~/.cache/kvcanary/``, built once from the
configured indexes; no torch), and run the console script from an empty folder: migrate SQLite,
serve, answer, stop on SIGTERM, and ``kvcanary check`` a real reference worker.
"""

from __future__ import annotations

import ast
import contextlib
import email
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import REPO, free_port, wait_http

ROOTS = ("monitor", "probes", "workers", "demo", "migrations", "alerts", "dashboards")


# --- the checkout -----------------------------------------------------------------------------------------


def test_each_folder_is_linked_under_kvcanary() -> None:
    for root in ROOTS:
        link = REPO / "kvcanary" / root
        assert link.is_symlink() and os.readlink(link) == f"../{root}", link
        assert link.resolve() == (REPO / root).resolve()


def repository_modules() -> list[Path]:
    """Every Python file of the repository (the folders, the tap, the tests, the benchmarks)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [REPO / name for name in filter(None, listed.split("\0")) if (REPO / name).is_file()]


def test_no_module_imports_a_folder_by_its_generic_name() -> None:
    """``import monitor`` beside ``import kvcanary.monitor`` would load one file as two modules (two
    registries, two settings): every import names the package users install."""
    found = {
        str(path.relative_to(REPO)): names
        for path in repository_modules()
        if (names := generic_imports(path.read_text(encoding="utf-8")))
    }
    assert found == {}


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
        if (REPO / name).is_symlink():  # kvcanary/<folder>: a link, as a clone has it
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(REPO / name), copy / name)
        elif (REPO / name).is_file():  # a tracked file deleted in the working tree is not built
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
            shipped = (".py", ".md", ".json", ".mako", ".yml", ".mtail")
            if path.suffix in shipped and "/tests/" not in f"/{relative}":
                expected.add(f"kvcanary/{relative}")
    assert expected - names == set()
    for must in (
        "kvcanary/migrations/env.py",
        "kvcanary/alerts/runbooks/KVCanaryLeak.md",
        "kvcanary/alerts/kvcanary.rules.yml",
        "kvcanary/alerts/mtail/sglang_kv_canary.mtail",
        "kvcanary/dashboards/kvcanary-overview.json",
        "kvcanary/dashboards/provisioning/dashboards.yml",
        "kvcanary/probes/data/isolation_defects.yml",
    ):
        assert must in names
    assert not any(n.endswith((".pyc", ".db")) or "/__pycache__/" in n for n in names)
    assert {n: generic_imports(s) for n, s in sources.items() if generic_imports(s)} == {}
    # The very files the tests run: nothing is rewritten at build time.
    for name, text in sources.items():
        assert text == (source / name).read_text(encoding="utf-8"), name


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
        import kvcanary.demo.run
        from kvcanary.monitor.storage.db import MIGRATIONS_DIR, head_revision
        from kvcanary.monitor.api.runbooks import RUNBOOKS_DIR
        from kvcanary.demo.stack import RULES
        from kvcanary.monitor.commands.dashboards import dashboard_files
        from kvcanary.probes.defects import DEFECTS_FILE, load_defects
        package = Path(kvcanary.__file__).parent
        assert package == Path({str(site)!r}) / "kvcanary", package
        for path in (MIGRATIONS_DIR / "env.py", RUNBOOKS_DIR / "KVCanaryLeak.md", RULES, DEFECTS_FILE):
            assert path.is_file() and path.is_relative_to(package), path
        assert [p.name for p in dashboard_files()] == ["kvcanary-overview.json", "kvcanary-workers.json"]
        assert load_defects() and head_revision()
        assert kvcanary.monitor.commands.cli.WORKERS_MODULE == "kvcanary.workers"
        assert kvcanary.demo.run.WORKERS_MODULE == "kvcanary.workers"
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


@pytest.mark.slow
def test_the_installed_check_judges_a_real_reference_worker(
    venv: Path, empty_dir: Path, start_worker: Any
) -> None:
    """The deploy gate from the wheel alone: ``kvcanary check`` against a healthy reference worker
    (started from this checkout: the wheel's venv has no torch) passes, and against the incident's
    defective one fails on the leak it finds."""
    keys = {"alice": "kvc-install-key-alice-0001", "bob": "kvc-install-key-bob-0002"}
    for tenant, key in keys.items():
        (empty_dir / f"key-{tenant}").write_text(key)
    api_keys = ["--api-key", f"{keys['alice']}=alice", "--api-key", f"{keys['bob']}=bob"]
    shape = ["--page-size", "16", "--context-window", "8192"]
    healthy = start_worker("--mode", "aggregated", "--kv-pool-tokens", "4096", *shape, *api_keys)
    defective = start_worker(
        "--mode", "disaggregated", "--prefill-pool-tokens", "1024", "--decode-pool-tokens", "4096",
        "--admission", "placeholder", *shape, *api_keys,
    )  # fmt: skip

    def check(url: str) -> subprocess.CompletedProcess[str]:
        config = empty_dir / "check.yml"
        config.write_text(
            textwrap.dedent(
                f"""\
                database_url: sqlite:///{empty_dir / "check.db"}
                targets:
                  - name: ref
                    base_url: {url}
                    engine: reference
                    model: kvcanary-reference
                    tenants:
                      - {{name: alice, api_key_file: {empty_dir / "key-alice"}}}
                      - {{name: bob, api_key_file: {empty_dir / "key-bob"}}}
                    probes: [canary, cross_tenant, boundary]
                """
            )
        )
        return run([venv / "kvcanary", "check", "--config", config], cwd=empty_dir, env=clean_env())

    passed = check(healthy.url)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    failed = check(defective.url)
    assert failed.returncode == 1 and "boundary" in failed.stdout, failed.stdout + failed.stderr
