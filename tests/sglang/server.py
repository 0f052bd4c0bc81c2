"""The SGLang engine itself (0.5.23) on this CPU as a test bed, started by the ``sglang_server``
fixture (``tests/sglang/conftest.py``) once per test session, on a free loopback port.

Opt-in: SGLang lives in its own venv, made by ``bash scripts/setup-sglang.sh``, and the tests run
only when ``KVCANARY_SGLANG_VENV`` names it (``scripts/test.sh`` builds no such venv and sets no such
variable, so the suite runs without it). ``KVCANARY_REQUIRE_SGLANG=1`` turns the skip into a
failure, so that a broken setup cannot pass as a green run.

The model is the vLLM tests' tiny random-weight Llama (``tests/vllm/make_tiny_model.py``), written
by the SGLang venv's own transformers into ``.cache/sglang-tiny-model`` (git-ignored). The engine
runs aggregated (one process serves prefill and decode): prefill/decode splitting needs CUDA here
(``docs/sglang-engine.md``). Startup takes 30-50 s on two cores (imports and warm-up); SIGTERM to
its process group stops the server, its scheduler and its detokenizer.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

from tests.support import REPO, free_port, stop_process, wait_http
from tests.vllm import make_tiny_model

MODEL_DIR = REPO / ".cache" / "sglang-tiny-model"
SERVED_MODEL = "tiny-llama"
#: The model's max_position_embeddings: with no --context-length, SGLang's context window.
CONTEXT_LEN = int(make_tiny_model.RECIPE["max_position_embeddings"])
#: The KV pool (--max-total-tokens): twice the window, the fixed deployment's headroom.
KV_POOL_TOKENS = 2 * CONTEXT_LEN
VERSION = "0.5.23"
#: Readiness judges nothing (a server that exits is seen at once): generous, as vLLM's, whose start
#: took over 180 s with two suites beside each other on two cores.
READY_TIMEOUT_S = 600.0

# Without SGLANG_USE_CPU_ENGINE the model's init imports vLLM's custom ops and dies. Offline: nothing
# can be downloaded here.
SERVER_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def venv() -> Path | None:
    """The venv KVCANARY_SGLANG_VENV names, or None when it is not set."""
    named = os.environ.get("KVCANARY_SGLANG_VENV", "").strip()
    return Path(named).expanduser() if named else None


@dataclass(frozen=True)
class SglangServer:
    """A running SGLang server: where it listens, what it serves, and its log."""

    url: str
    model_name: str
    context_len: int
    kv_pool_tokens: int
    log_path: Path

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def first_error(self, chars: int = 3000) -> str:
        """The log from its first error on: the cause, where the tail shows only what it led to."""
        text = self.log_text()
        found = [i for i in (text.find("Traceback"), text.find(" ERROR ")) if i >= 0]
        return text[min(found) :][:chars] if found else "(no error in the log)"


def _required() -> bool:
    return os.environ.get("KVCANARY_REQUIRE_SGLANG", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(reason: str) -> NoReturn:
    """Skip, or fail when the run requires SGLang; either way the call does not return."""
    if _required():
        pytest.fail(f"KVCANARY_REQUIRE_SGLANG is set but {reason}", pytrace=False)
    pytest.skip(reason)


def python_of_a_built_venv() -> Path:
    """Return the SGLang venv's python; skip (or fail, when required) unless setup finished there."""
    where = venv()
    if where is None:
        unavailable("KVCANARY_SGLANG_VENV is not set (`bash scripts/setup-sglang.sh`, then name its venv)")
    if not (where / "bin" / "python").exists():
        unavailable(f"{where} has no python: run `bash scripts/setup-sglang.sh`")
    if not (where / ".kvcanary-setup").is_file():
        unavailable(f"{where} is incomplete (no .kvcanary-setup): rerun `bash scripts/setup-sglang.sh`")
    return where / "bin" / "python"


def make_model(python: Path) -> None:
    """Write the tiny model with the SGLang venv's transformers (once; its recipe stamp says when)."""
    done = subprocess.run(
        [str(python), make_tiny_model.__file__, str(MODEL_DIR)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"make_tiny_model.py failed ({done.returncode}):\n{done.stdout}{done.stderr[-4000:]}")


def server_argv(python: Path, port: int, *extra: str) -> list[str]:
    return [
        str(python), "-m", "sglang.launch_server",
        "--model-path", str(MODEL_DIR),
        "--served-model-name", SERVED_MODEL,
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--disable-cuda-graph",
        # A share of the machine's memory for the pool, capped below by --max-total-tokens, so a
        # large share costs nothing: SGLang measures free memory before and after loading the
        # weights and refuses to start where the drop passes the share, and at 0.1 a second suite
        # starting beside it took more than a tenth in that moment (the whole module errored).
        "--mem-fraction-static", "0.5",
        "--max-total-tokens", str(KV_POOL_TOKENS),
        "--enable-metrics",
        # Fills usage.prompt_tokens_details.cached_tokens, which shows radix-cache hits.
        "--enable-cache-report",
        # Idle, the scheduler sleeps instead of spinning: the server lives through the whole suite,
        # and a spinning one took half of this 2-core machine from every other test.
        "--sleep-on-idle",
        "--host", "127.0.0.1",
        "--port", str(port),
        *extra,
    ]  # fmt: skip


def start_server(
    python: Path, workdir: Path, *extra: str, env: Mapping[str, str] | None = None
) -> tuple[SglangServer, subprocess.Popen[bytes] | None, str]:
    """Start the server (``extra`` flags, ``env`` beside ``SERVER_ENV``) and wait until it answers
    /health (after its warm-up request): the server and its process, or no process and what went
    wrong (the log's first error)."""
    port = free_port()
    log_path = workdir / f"sglang-server-{port}.log"
    with log_path.open("wb") as log:
        # cwd is the temporary folder so that the repo's top-level packages cannot shadow SGLang's.
        proc = subprocess.Popen(
            server_argv(python, port, *extra), stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
            env={**os.environ, **SERVER_ENV, **(env or {})}, start_new_session=True,
        )  # fmt: skip
    server = SglangServer(f"http://127.0.0.1:{port}", SERVED_MODEL, CONTEXT_LEN, KV_POOL_TOKENS, log_path)
    try:
        wait_http(server.url + "/health", timeout=READY_TIMEOUT_S, proc=proc, every=0.5)
    except (RuntimeError, TimeoutError) as exc:
        stop_process(proc, timeout=30)
        return server, None, f"--- {log_path}: {exc}\n{server.first_error()}"
    return server, proc, ""
