"""Real llama-cpp-python servers as a test bed, started on demand on free loopback ports by the
``llamacpp_servers`` fixture (``tests/llamacpp/conftest.py``).

llama-cpp-python lives in its own venv outside the clone, made by ``bash scripts/setup-llamacpp.sh``
(default ``${XDG_CACHE_HOME:-~/.cache}/kvcanary/venv-llamacpp``, or ``$KVCANARY_LLAMACPP_VENV``).
Without it the tests are skipped, unless ``KVCANARY_REQUIRE_LLAMACPP=1`` (CI sets it), which
turns the skip into a failure, so that a broken setup cannot pass as a green run.

The server is llama-cpp-python's own ``python -m llama_cpp.server`` (FastAPI over the llama.cpp
library), not llama.cpp's C++ ``llama-server``: it has no ``/props``, ``/slots`` or ``/metrics`` and
no ``--n_parallel``; it serves one request at a time (see tests/llamacpp/README.md). No model can be
downloaded: ``tests/llamacpp/make_tiny_gguf.py`` writes a 0.5 MB random-weight GGUF into the
session's temporary folder. A server is ready in about a second and stopped with SIGTERM to its
process group.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support import REPO, free_port, stop_process, wait_http

_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvcanary"
VENV = Path(os.environ.get("KVCANARY_LLAMACPP_VENV") or _CACHE / "venv-llamacpp")
LLAMACPP_PYTHON = VENV / "bin" / "python"
SETUP_STAMP = VENV / ".kvcanary-setup"
MAKE_MODEL = REPO / "tests" / "llamacpp" / "make_tiny_gguf.py"

MODEL_ALIAS = "tiny"
DEFAULT_N_CTX = 256
#: Readiness judges nothing (a server that exits is seen at once): room for a machine loaded by two
#: suites (vLLM's start took over 180 s there; llama.cpp's server imports far less).
READY_TIMEOUT_S = 180.0
# The server reads unset settings from the environment by field name (pydantic-settings, no prefix:
# API_KEY, CACHE, CONFIG_FILE, N_CTX, ...), so it gets only what a process needs to run.
_PASSED_ENV = ("PATH", "HOME", "TMPDIR", "LANG", "LC_ALL")


@dataclass(frozen=True)
class LlamaCppServer:
    """A running ``llama_cpp.server``: where it listens and how it was started."""

    url: str
    model_name: str
    n_ctx: int
    model_path: Path
    log_path: Path
    flags: tuple[str, ...] = field(default=())

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]


def _required() -> bool:
    return os.environ.get("KVCANARY_REQUIRE_LLAMACPP", "").strip().lower() not in ("", "0", "false", "no")


def _unavailable(reason: str) -> None:
    """Skip, or fail when the run requires llama.cpp; either way the call does not return."""
    if _required():
        pytest.fail(f"KVCANARY_REQUIRE_LLAMACPP is set but {reason}", pytrace=False)
    pytest.skip(reason)


def check_venv() -> None:
    if not LLAMACPP_PYTHON.exists():
        _unavailable(f"{VENV} is missing: run `bash scripts/setup-llamacpp.sh`")
    if not SETUP_STAMP.is_file():
        _unavailable(f"{VENV} is incomplete (no {SETUP_STAMP.name}): rerun `bash scripts/setup-llamacpp.sh`")


def make_model(path: Path) -> None:
    done = subprocess.run(
        [str(LLAMACPP_PYTHON), str(MAKE_MODEL), str(path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"make_tiny_gguf.py failed ({done.returncode}):\n{done.stdout}{done.stderr[-4000:]}")


def _server_argv(model: Path, port: int, n_ctx: int, flags: tuple[str, ...]) -> list[str]:
    return [
        str(LLAMACPP_PYTHON), "-m", "llama_cpp.server",
        "--model", str(model),
        "--model_alias", MODEL_ALIAS,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--n_ctx", str(n_ctx),
        *flags,
    ]  # fmt: skip


def start_server(
    model: Path, workdir: Path, n_ctx: int, flags: tuple[str, ...]
) -> tuple[LlamaCppServer, subprocess.Popen[bytes]]:
    port = free_port()
    log_path = workdir / f"llamacpp-{n_ctx}-{port}.log"
    env = {name: os.environ[name] for name in _PASSED_ENV if name in os.environ}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            _server_argv(model, port, n_ctx, flags), stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
            env=env, start_new_session=True,
        )  # fmt: skip
    server = LlamaCppServer(f"http://127.0.0.1:{port}", MODEL_ALIAS, n_ctx, model, log_path, flags)
    try:
        wait_http(server.url + "/v1/models", timeout=READY_TIMEOUT_S, proc=proc)
    except (RuntimeError, TimeoutError) as exc:
        stop_process(proc)
        pytest.fail(f"llama_cpp.server did not start: {exc}\n--- {log_path} (tail) ---\n{server.log_tail()}")
    return server, proc
