"""A real vLLM server (its CPU build) as a test bed, started by the ``vllm_server`` fixture
(``tests/vllm/conftest.py``) once per test session, on a free loopback port.

vLLM lives in its own venv, ``.venv-vllm``, made by ``bash scripts/setup-vllm.sh``. Without it the
tests are skipped, unless ``KVCANARY_REQUIRE_VLLM=1`` (CI sets it), which turns the skip into
a failure, so that a broken setup cannot pass as a green run.

No model can be downloaded here: ``tests/vllm/make_tiny_model.py`` writes a tiny random-weight Llama
into ``.cache/vllm-tiny-model`` (git-ignored) the first time, in about 10 s. The server starts in about
45 s (mostly imports; longer on a busy machine), answers in milliseconds, and is stopped with SIGTERM
to its process group (it runs four processes).

Set ``KVCANARY_RECORD_VLLM=1`` to rewrite the recorded shapes in ``tests/fixtures/`` from the live
server (see :func:`record`); ordinary runs only read them.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import REPO, free_port, stop_process, wait_http

VENV = Path(os.environ.get("KVCANARY_VLLM_VENV") or REPO / ".venv-vllm")
VLLM_PYTHON = VENV / "bin" / "python"
SETUP_STAMP = VENV / ".kvcanary-setup"
MODEL_DIR = REPO / ".cache" / "vllm-tiny-model"
MAKE_MODEL = REPO / "tests" / "vllm" / "make_tiny_model.py"
FIXTURES = REPO / "tests" / "fixtures"

SERVED_MODEL = "tiny-llama"
MAX_MODEL_LEN = 1024
# The CPU backend wants a multiple of 32 (16 fails at startup).
BLOCK_SIZE = 32
# Startup is three processes importing torch and vLLM one after the other: 44 CPU-seconds, so about
# 45 s on an idle two-core machine, up to 104 s measured while other suites ran beside it, and more
# than 180 s (twice in a row, in each of two suites) with two suites' vLLMs starting at once on two
# cores (load 18). Waiting longer judges nothing: a server that exits is seen at once (``proc``).
# (`--distributed-executor-backend uni` would save one import, but vLLM's CPU platform turns it
# back into "mp": OpenMP thread binding needs the worker process.)
READY_TIMEOUT_S = 600.0

# Offline (nothing can be downloaded), no usage reports, and a 1 GiB KV pool instead of vLLM's
# default share of memory: plenty for 1,024-token requests, and cheap on a 24 GiB machine.
SERVER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


@dataclass(frozen=True)
class VllmServer:
    """A running vLLM server: where it listens and what it serves."""

    url: str
    model_name: str
    max_model_len: int
    block_size: int
    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def first_error(self, chars: int = 3000) -> str:
        """The log from its first error on: the cause, where the tail shows only what it led to."""
        text = self.log_path.read_text(errors="replace")
        found = [i for i in (text.find(" ERROR "), text.find("Traceback"), text.find("died")) if i >= 0]
        return text[min(found) :][:chars] if found else "(no error in the log)"


def _required() -> bool:
    return os.environ.get("KVCANARY_REQUIRE_VLLM", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(reason: str) -> None:
    """Skip, or fail when the run requires vLLM; either way the call does not return."""
    if _required():
        pytest.fail(f"KVCANARY_REQUIRE_VLLM is set but {reason}", pytrace=False)
    pytest.skip(reason)


def _server_argv(port: int) -> list[str]:
    # `vllm serve` fails with the CPU build: it looks up the version of a distribution named "vllm".
    return [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(MODEL_DIR),
        "--served-model-name", SERVED_MODEL,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--block-size", str(BLOCK_SIZE),
        "--dtype", "float32",
        # Without it, startup compiles the model and takes about 60 s instead of 25.
        "--enforce-eager",
        # Fills usage.prompt_tokens_details.cached_tokens, which shows prefix-cache hits.
        "--enable-prompt-tokens-details",
    ]  # fmt: skip


def make_model() -> None:
    done = subprocess.run(
        [str(VLLM_PYTHON), str(MAKE_MODEL), str(MODEL_DIR)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"make_tiny_model.py failed ({done.returncode}):\n{done.stdout}{done.stderr[-4000:]}")


def start_server(workdir: Path, attempt: str) -> tuple[VllmServer, subprocess.Popen[bytes] | None, str]:
    """Start the server and wait until it answers: the server and its process, or no process and
    what went wrong (the log's first error and its tail)."""
    port = free_port()
    log_path = workdir / f"vllm-server-{attempt}.log"
    with log_path.open("wb") as log:
        # cwd is the temporary folder so that the repo's top-level packages cannot shadow vLLM's imports.
        proc = subprocess.Popen(
            _server_argv(port), stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
            env={**os.environ, **SERVER_ENV}, start_new_session=True,
        )  # fmt: skip
    server = VllmServer(f"http://127.0.0.1:{port}", SERVED_MODEL, MAX_MODEL_LEN, BLOCK_SIZE, log_path)
    try:
        wait_http(server.url + "/v1/models", timeout=READY_TIMEOUT_S, proc=proc)
    except (RuntimeError, TimeoutError) as exc:
        stop_process(proc, timeout=30)
        return server, None, f"--- {log_path}: {exc}\n{server.first_error()}\n(tail)\n{server.log_tail()}"
    return server, proc, ""


def recording() -> bool:
    return os.environ.get("KVCANARY_RECORD_VLLM", "") == "1"


def record(relative: str, text: str) -> None:
    """Write ``text`` to ``tests/fixtures/RELATIVE`` when KVCANARY_RECORD_VLLM=1; else do nothing.

    The recorded files are committed: other tests replay vLLM's shapes from them without a server.
    """
    if not recording():
        return
    path = FIXTURES / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n")
