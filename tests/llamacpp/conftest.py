"""Real llama-cpp-python servers as a test bed (``tests.support.llamacpp``: how they start).

Without the llama.cpp venv (``bash scripts/setup-llamacpp.sh``) the tests here are skipped, unless
``KVCANARY_REQUIRE_LLAMACPP=1`` (CI sets it), which turns the skip into a failure.

Fixtures:
- ``llamacpp_server``: the shared server, ``--n_ctx 256``.
- ``llamacpp_servers``: a factory, ``llamacpp_servers(n_ctx=2048, interrupt_requests=False)``, for
  other context sizes or flags. Servers are kept per argument set for the whole session, so tests
  asking for the same one share it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.support import stop_process
from tests.support.llamacpp import DEFAULT_N_CTX, LlamaCppServer, check_venv, make_model, start_server


@pytest.fixture(scope="session")
def llamacpp_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LlamaCppServer]]:
    """Yield ``start(n_ctx=256, interrupt_requests=True, extra=())``, which returns a ready server.

    Ask for a multiple of 256: llama.cpp pads the context up to one, and llama-cpp-python then fails
    with a 500 on prompts that fall into the padding (see test_llamacpp_context.py).

    ``interrupt_requests=False`` stops the server from cutting a running stream when another request
    arrives (its default cuts it). ``extra`` is passed to ``llama_cpp.server`` as more flags, for
    instance ``("--cache", "true")``. Every server started is stopped at the end of the session.
    """
    check_venv()
    workdir = tmp_path_factory.mktemp("llamacpp")
    model = workdir / "tiny.gguf"
    make_model(model)
    running: dict[tuple[int, tuple[str, ...]], tuple[LlamaCppServer, subprocess.Popen[bytes]]] = {}

    def start(
        n_ctx: int = DEFAULT_N_CTX, interrupt_requests: bool = True, extra: tuple[str, ...] = ()
    ) -> LlamaCppServer:
        flags = (() if interrupt_requests else ("--interrupt_requests", "false")) + tuple(extra)
        key = (n_ctx, flags)
        if key not in running:
            running[key] = start_server(model, workdir, n_ctx, flags)
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
