"""Real llama-cpp-python servers as a test bed: started on demand, on free loopback ports.

llama-cpp-python lives in its own venv outside the clone, made by ``bash scripts/setup-llamacpp.sh``
(default ``${XDG_CACHE_HOME:-~/.cache}/kvcanary/venv-llamacpp``, or ``$KVCANARY_LLAMACPP_VENV``).
Without it the tests here are skipped, unless ``KVCANARY_REQUIRE_LLAMACPP=1`` (CI sets it), which
turns the skip into a failure, so that a broken setup cannot pass as a green run.

The server is llama-cpp-python's own ``python -m llama_cpp.server`` (FastAPI over the llama.cpp
library), not llama.cpp's C++ ``llama-server``: it has no ``/props``, ``/slots`` or ``/metrics`` and
no ``--n_parallel``; it serves one request at a time (see README.md here). No model can be
downloaded: ``make_tiny_gguf.py`` writes a 0.5 MB random-weight GGUF into the session's temporary
folder. A server is ready in about a second and stopped with SIGTERM to its process group.

Fixtures:
- ``llamacpp_server``: the shared server, ``--n_ctx 256``.
- ``llamacpp_servers``: a factory, ``llamacpp_servers(n_ctx=2048, interrupt_requests=False)``, for
  other context sizes or flags. Servers are kept per argument set for the whole session, so tests
  asking for the same one share it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, stop_process, wait_http

_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvcanary"
VENV = Path(os.environ.get("KVCANARY_LLAMACPP_VENV") or _CACHE / "venv-llamacpp")
LLAMACPP_PYTHON = VENV / "bin" / "python"
SETUP_STAMP = VENV / ".kvcanary-setup"
MAKE_MODEL = Path(__file__).with_name("make_tiny_gguf.py")

MODEL_ALIAS = "tiny"
DEFAULT_N_CTX = 256
READY_TIMEOUT_S = 60.0
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


def _check_venv() -> None:
    if not LLAMACPP_PYTHON.exists():
        _unavailable(f"{VENV} is missing: run `bash scripts/setup-llamacpp.sh`")
    if not SETUP_STAMP.is_file():
        _unavailable(f"{VENV} is incomplete (no {SETUP_STAMP.name}): rerun `bash scripts/setup-llamacpp.sh`")


def _make_model(path: Path) -> None:
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


def _start(
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


@pytest.fixture(scope="session")
def llamacpp_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LlamaCppServer]]:
    """Yield ``start(n_ctx=256, interrupt_requests=True, extra=())``, which returns a ready server.

    Ask for a multiple of 256: llama.cpp pads the context up to one, and llama-cpp-python then fails
    with a 500 on prompts that fall into the padding (see test_llamacpp_context.py).

    ``interrupt_requests=False`` stops the server from cutting a running stream when another request
    arrives (its default cuts it). ``extra`` is passed to ``llama_cpp.server`` as more flags, for
    instance ``("--cache", "true")``. Every server started is stopped at the end of the session.
    """
    _check_venv()
    workdir = tmp_path_factory.mktemp("llamacpp")
    model = workdir / "tiny.gguf"
    _make_model(model)
    running: dict[tuple[int, tuple[str, ...]], tuple[LlamaCppServer, subprocess.Popen[bytes]]] = {}

    def start(
        n_ctx: int = DEFAULT_N_CTX, interrupt_requests: bool = True, extra: tuple[str, ...] = ()
    ) -> LlamaCppServer:
        flags = (() if interrupt_requests else ("--interrupt_requests", "false")) + tuple(extra)
        key = (n_ctx, flags)
        if key not in running:
            running[key] = _start(model, workdir, n_ctx, flags)
        return running[key][0]

    try:
        yield start
    finally:
        for _, proc in running.values():
            stop_process(proc)


@pytest.fixture(scope="session")
def llamacpp_server(llamacpp_servers: Callable[..., LlamaCppServer]) -> LlamaCppServer:
    """The shared server: the tiny model as ``tiny``, ``--n_ctx 256``, default flags."""
    return llamacpp_servers()


@pytest.fixture(scope="module")
def client(llamacpp_server: LlamaCppServer) -> Iterator[httpx.Client]:
    """A client of the shared server, one per test module."""
    with httpx.Client(base_url=llamacpp_server.url, timeout=30.0) as c:
        yield c
