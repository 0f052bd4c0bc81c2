"""`kvcanary check`, the deploy gate, through the real CLI against reference workers as processes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import REPO, WorkerProcess, free_port
from tests.support.pace import PROCESS_SECONDS

DEFECTIVE = ["--mode", "disaggregated", "--admission", "placeholder"]
POOLS = ["--prefill-pool-tokens", "1024", "--decode-pool-tokens", "8192", "--context-window", "8192"]


def write_config(tmp: Path, urls: dict[str, str]) -> Path:
    targets: list[dict[str, Any]] = [
        {
            "name": name,
            "base_url": url,
            "engine": "reference",
            "model": "kvcanary-reference",
            "tenants": [{"name": "tenant-a"}, {"name": "tenant-b"}],
            "timeout_seconds": 10,
        }
        for name, url in urls.items()
    ]
    path = tmp / "kvcanary.yml"
    path.write_text(yaml.safe_dump({"database_url": f"sqlite:///{tmp}/x.db", "targets": targets}))
    return path


def check(config: Path, *extra: str) -> tuple[int, list[dict[str, str]]]:
    proc = subprocess.run(
        [sys.executable, "-m", "monitor", "check", "--config", str(config), "--json", *extra],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=PROCESS_SECONDS,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode, lines


@pytest.mark.slow
def test_check_passes_a_healthy_node_and_fails_a_defective_one(
    tmp_path: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    healthy = start_worker("--mode", "aggregated", "--kv-pool-tokens", "8192", "--context-window", "4096")
    defective = start_worker(*DEFECTIVE, *POOLS)
    config = write_config(tmp_path, {"healthy": healthy.url, "defective": defective.url})

    # A target that states only its URL and tenants is audited too: its pools against its window,
    # its version and its counters, with no request sent.
    code, lines = check(config, "--target", "healthy")
    assert code == 0, lines
    assert {(line["probe"], line["verdict"]) for line in lines} == {
        ("canary", "pass"),
        ("cross_tenant", "pass"),
        ("boundary", "pass"),
        ("capacity", "pass"),
        ("version", "pass"),
        ("counters", "pass"),
    }

    code, lines = check(config)
    assert code == 1
    verdicts = {(line["target"], line["probe"]): line["verdict"] for line in lines}
    assert verdicts[("defective", "boundary")] in ("leak", "mismatch")
    assert verdicts[("defective", "capacity")] == "mismatch"  # the incident's pool under its window
    assert verdicts[("healthy", "boundary")] == "pass"


def test_check_exits_3_when_errors_alone_keep_it_from_judging(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"gone": f"http://127.0.0.1:{free_port()}"})
    code, lines = check(config)
    assert code == 3
    assert {line["verdict"] for line in lines} == {"error"}
    assert all(line["reason"] for line in lines)


def test_check_refuses_an_unknown_target_name(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"a": "http://127.0.0.1:1"})
    code, _ = check(config, "--target", "b")
    assert code == 2


def test_check_with_nothing_to_check_is_no_pass(tmp_path: Path) -> None:
    """A deploy gate that probed nothing must not say 0 ("all passed")."""
    config = write_config(tmp_path, {})
    proc = subprocess.run([sys.executable, "-m", "monitor", "check", "--config", str(config)],
                          capture_output=True, text=True, cwd=REPO, timeout=PROCESS_SECONDS)  # fmt: skip
    assert proc.returncode == 3 and "nothing was checked" in proc.stderr


def test_check_of_one_target_needs_no_key_of_another(tmp_path: Path) -> None:
    config = write_config(
        tmp_path, {"gone": f"http://127.0.0.1:{free_port()}", "other": "http://127.0.0.1:1"}
    )
    data = yaml.safe_load(config.read_text())
    data["targets"][1]["tenants"][0]["api_key_env"] = "KVC_TEST_KEY_NOBODY_SET"
    config.write_text(yaml.safe_dump(data))
    code, lines = check(config, "--target", "gone")
    assert code == 3 and {line["target"] for line in lines} == {"gone"}
    assert check(config)[0] == 2  # checking "other" does need its key


def test_the_worker_command_documents_every_flag() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "monitor", "worker", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=PROCESS_SECONDS,
    )
    assert proc.returncode == 0, proc.stderr
    for flag in (
        "--mode",
        "--admission",
        "--kv-pool-tokens",
        "--prefill-pool-tokens",
        "--decode-pool-tokens",
        "--page-size",
        "--context-window",
        "--verify-ownership",
        "--zero-freed-pages",
        "--api-key",
        "--device",
    ):
        assert flag in proc.stdout
