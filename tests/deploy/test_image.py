"""The image deploy/Containerfile builds runs the monitor as the manifests expect: as uid 10001, the
database migrated by ``kvcanary db upgrade``, ``kvcanary serve`` answering /healthz, /metrics and
/runbooks, the OpenTelemetry SDK inside.

Opt-in, since a build costs minutes: ``KVCANARY_TEST_IMAGE=localhost/kvcanary:0.1.0`` names an
image ``deploy/build-image.sh`` built; buildah runs it with chroot isolation (the only isolation that
works inside this project's machines, which are containers themselves: docs/operating.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import free_port, stop_process, wait_http

IMAGE = os.environ.get("KVCANARY_TEST_IMAGE", "")

pytestmark = pytest.mark.skipif(
    not IMAGE or shutil.which("buildah") is None,
    reason="set KVCANARY_TEST_IMAGE to an image deploy/build-image.sh built (needs buildah, as root)",
)


@pytest.fixture
def container() -> Iterator[str]:
    made = subprocess.run(["buildah", "from", IMAGE], capture_output=True, text=True, timeout=120, check=True)
    name = made.stdout.strip()
    yield name
    subprocess.run(["buildah", "rm", name], capture_output=True, timeout=60)


def run(container: str, data: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    command = ["buildah", "run", "--isolation=chroot", "-v", f"{data}:/data", container, "--", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_the_image_migrates_and_serves_as_uid_10001(container: str, tmp_path: Path) -> None:
    port = free_port()
    data = tmp_path / "data"
    data.mkdir(mode=0o777)
    data.chmod(0o777)  # the image's user owns nothing here
    (data / "token").write_text("an-api-token-for-the-image-test-0001\n")
    (data / "kvcanary.yml").write_text(
        f"database_url: sqlite:////data/kvcanary.db\napi:\n  listen: 127.0.0.1:{port}\n"
        "  token_file: /data/token\notel:\n  endpoint: http://127.0.0.1:9\n"
    )
    for path in data.iterdir():
        path.chmod(0o644)
    assert run(container, data, "id", "-u").stdout.strip() == "10001"
    migrated = run(container, data, "kvcanary", "db", "upgrade", "--config", "/data/kvcanary.yml")
    assert migrated.returncode == 0, migrated.stderr
    log = (tmp_path / "serve.log").open("wb")
    command = ["buildah", "run", "--isolation=chroot", "-v", f"{data}:/data", container, "--",
               "kvcanary", "serve", "--config", "/data/kvcanary.yml"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/healthz", timeout=90, proc=proc)
        assert httpx.get(url + "/healthz", timeout=10).json()["status"] == "ok"
        assert httpx.get(url + "/runbooks", timeout=10).status_code == 200
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'kvcanary_otel_events_dropped_total{reason="queue_full"}' in metrics
    finally:
        stop_process(proc)
