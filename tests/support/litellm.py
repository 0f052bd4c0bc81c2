"""A real LiteLLM proxy (1.110.2, its own venv) with the kvcanary tap, as the gateway under test.

The venv is ``$KVCANARY_LITELLM_VENV`` (or ``.venv-litellm``), made by ``bash
scripts/setup-litellm.sh``; ``tests/litellm/conftest.py`` skips the tests without it.

The proxy runs without its database (Prisma cannot be fetched here): callers are static keys
through ``custom_auth`` (a file beside the config returning each key's team), retries are off,
and it binds 127.0.0.1. The tap is imported from this checkout (``PYTHONPATH``), as an installed
``kvcanary`` would be: the venv holds nothing of the monitor's.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support import REPO, free_port, stop_process, wait_http

VENV = Path(os.environ.get("KVCANARY_LITELLM_VENV") or REPO / ".venv-litellm")
LITELLM = VENV / "bin" / "litellm"
MASTER_KEY = "sk-kvcanary-test-master"
TAP_CALLBACK = "kvcanary.tap.litellm.tap"
#: A proxy starts in about 6 s on an idle 2-core machine (imports, mostly). Under the whole suite on
#: parallel workers, beside a vLLM or llama.cpp server busy on both cores, two CI runs saw starts pass
#: 90 s: a start is not a test, so it gets room, and proxies start one at a time (``_one_start``).
START_TIMEOUT_S = 240.0
#: How long a start waits for the machine's start lock. A holder holds it for one start at most
#: (``START_TIMEOUT_S``), so waiting is a queue, never a hang: two suites side by side with a third
#: LiteLLM test beside them queued past twice a start's bound (five tests failed waiting, at a load of
#: 20-30). Room for every worker of two suites (eight) to start ahead.
LOCK_WAIT_S = 8 * START_TIMEOUT_S
#: Customer keys → (team, key alias). The keys never reach the monitor; their teams do.
CALLERS = {
    "sk-acme-0001": ("acme", "acme-prod"),
    "sk-globex-0002": ("globex", "globex-batch"),
    "sk-initech-0003": ("initech", "initech-app"),
}

CUSTOM_AUTH = """
from fastapi import HTTPException, Request
from litellm.proxy._types import UserAPIKeyAuth

CALLERS = {callers!r}


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    key = api_key.removeprefix("Bearer ").strip()
    if key not in CALLERS:
        raise HTTPException(status_code=401, detail="unknown key")
    team, alias = CALLERS[key]
    return UserAPIKeyAuth(api_key=key, team_id=team, team_alias=team, key_alias=alias, user_id=team)
"""


def litellm_ready() -> bool:
    return LITELLM.exists() and (VENV / ".kvcanary-setup").exists()


@dataclass
class Proxy:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def write_proxy_config(
    folder: Path,
    models: dict[str, str],
    callback: str | list[str] | None = TAP_CALLBACK,
    callers: dict[str, tuple[str, str]] | None = None,
) -> Path:
    """Write config.yaml and custom_auth.py: ``models`` maps a model name to its backend's URL;
    ``callback`` is the ``litellm_settings.callbacks`` entry or entries (None: none); ``callers``
    the keys custom_auth knows (default ``CALLERS``)."""
    folder.mkdir(parents=True, exist_ok=True)
    known = CALLERS if callers is None else callers
    (folder / "custom_auth.py").write_text(textwrap.dedent(CUSTOM_AUTH.format(callers=known)))
    config: dict[str, Any] = {
        "model_list": [
            {
                "model_name": name,
                "litellm_params": {
                    "model": "openai/kvcanary-reference",
                    "api_base": f"{url}/v1",
                    "api_key": "gateway",
                },
            }
            for name, url in models.items()
        ],
        "litellm_settings": {"telemetry": False, "num_retries": 0, "request_timeout": 60},
        "general_settings": {"custom_auth": "custom_auth.user_api_key_auth", "master_key": MASTER_KEY},
    }
    if callback is not None:
        config["litellm_settings"]["callbacks"] = callback
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_proxy(
    folder: Path,
    models: dict[str, str],
    tap_env: dict[str, str] | None,
    callback: str | list[str] | None = TAP_CALLBACK,
    callers: dict[str, tuple[str, str]] | None = None,
    files: dict[str, str] | None = None,
    port: int | None = None,
) -> Proxy:
    """Start a proxy in ``folder``; with ``tap_env`` None, no callback at all. ``files`` are written
    beside the config first (a callback module of the test's own); ``port``: where it listens (a
    free one unless told: a restarted gateway takes its old one)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (files or {}).items():
        (folder / name).write_text(text)
    config = write_proxy_config(folder, models, callback if tap_env is not None else None, callers)
    return launch_proxy(config, tap_env, port)


def launch_proxy(config: Path, tap_env: dict[str, str] | None, port: int | None = None) -> Proxy:
    """Run LiteLLM on ``config`` (in its folder) with the tap's ``tap_env``; return it once live."""
    folder = config.parent
    port = port or free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("KVCANARY_TAP", "PYTHON"))},
        "LITELLM_OFFLINE_MODE": "true",
        "LITELLM_LOG": "ERROR",
        "PYTHONPATH": str(REPO),
        **(tap_env or {}),
    }
    log = folder / f"litellm-{port}.log"
    with _one_start():
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [str(LITELLM), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
                stdout=out, stderr=subprocess.STDOUT, cwd=folder, env=env, start_new_session=True,
            )  # fmt: skip
        proxy = Proxy(f"http://127.0.0.1:{port}", proc, log)
        started = time.monotonic()
        try:
            wait_http(f"{proxy.url}/health/liveliness", timeout=START_TIMEOUT_S, proc=proc)
        except Exception as exc:
            stop_process(proc)
            waited = time.monotonic() - started
            raise RuntimeError(
                f"LiteLLM did not start in {waited:.0f}s: {exc}\n{proxy.output()[-4000:]}"
            ) from exc
    return proxy


@contextmanager
def _one_start() -> Iterator[None]:
    """Hold the machine's LiteLLM start lock (a file in the venv, which every clone's tests share):
    two proxies importing at once on 2 cores each take twice as long, and neither is a test."""
    with (VENV / ".kvcanary-start.lock").open("w") as lock:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError("another LiteLLM proxy held the start lock too long") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def litellm_migrations() -> list[Path]:
    """LiteLLM's published database migrations (``litellm-proxy-extras``), oldest first."""
    found = sorted(VENV.glob("lib/python3*/site-packages/litellm_proxy_extras/migrations/*/migration.sql"))
    assert found, f"no LiteLLM migrations in {VENV}"
    return found
