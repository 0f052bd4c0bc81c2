"""The command line: every flag documented, bad values exit 2 naming the flag, keys files parse."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvcanary.workers.cli import build_parser, config_from_args, main
from kvcanary.workers.config import WorkerConfig
from tests.support import REPO, WorkerProcess
from tests.support.pace import PROCESS_SECONDS


def test_it_documents_every_flag_in_help() -> None:
    parser = build_parser()
    undocumented = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
    assert undocumented == []
    help_text = subprocess.run(
        [sys.executable, "-m", "kvcanary.workers", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=PROCESS_SECONDS,
    ).stdout
    for action in parser._actions:
        for flag in action.option_strings:
            assert flag in help_text


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--page-size", "0"], "--page-size"),
        (["--mode", "pd"], "--mode"),
        (["--admission", "maybe"], "--admission"),
        (["--kv-pool-tokens", "8"], "--kv-pool-tokens"),
        (["--mode", "disaggregated", "--prefill-pool-tokens", "10"], "--prefill-pool-tokens"),
        (["--context-window", "1"], "--context-window"),
        (["--max-batch", "0"], "--max-batch"),
        (["--api-key", "no-tenant"], "--api-key"),
        (["--api-keys-file", "/nonexistent/keys"], "--api-keys-file"),
        (["--port", "70000"], "--port"),
        (["--device", "tpu"], "--device"),
        (["--prefix-cache", "global"], "--prefix-cache"),
    ],
)
def test_it_exits_2_naming_the_flag_of_a_bad_value(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--device", "cpu"] if "--device" not in argv else argv)
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err


def test_it_reads_keys_from_flags_and_files(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nsk-a = alice\n\nsk-b=bob\n")
    args = build_parser().parse_args(
        ["--device", "cpu", "--api-keys-file", str(keys), "--api-key", "sk-c=carol"]
    )
    assert config_from_args(args).api_keys == {"sk-a": "alice", "sk-b": "bob", "sk-c": "carol"}


def test_it_sizes_both_disaggregated_pools_from_kv_pool_tokens_by_default() -> None:
    config = WorkerConfig(mode="disaggregated", kv_pool_tokens=2010, page_size=16, prefill_pool_tokens=1024)
    assert config.pool_tokens == {"prefill": 1024, "decode": 2000}
    assert config.max_req_input_len == 1023
    assert config.context_exceeds_pool


def test_it_turns_the_prefix_cache_on_by_flag_and_leaves_it_off_by_default() -> None:
    parser = build_parser()
    assert config_from_args(parser.parse_args(["--device", "cpu"])).prefix_cache == "off"
    args = parser.parse_args(["--device", "cpu", "--prefix-cache", "per-tenant"])
    assert config_from_args(args).prefix_cache == "per-tenant"


def test_the_deprecated_single_mode_starts_and_says_what_to_write_instead(
    start_worker: Callable[..., WorkerProcess],
) -> None:
    worker = start_worker("--mode", "single", "--kv-pool-tokens", "1024")
    assert "--mode single is deprecated" in worker.output()
    assert "use --mode aggregated" in worker.output()
    assert 'mode="single"' in httpx.get(worker.url + "/metrics").text
