"""The credential keys of a target: ``credential_hosts``, ``worker_api_key_env`` and
``worker_api_key_file``. A bad entry or a missing key is refused naming the key (exit 2 from the CLI),
and no message ever holds a key."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcanary.monitor.config.secrets import tenant_keys
from kvcanary.monitor.config.settings import ConfigError, parse_settings
from tests.support.pace import PROCESS_SECONDS

REPO = Path(__file__).resolve().parents[3]


def target(**fields: Any) -> dict[str, Any]:
    return {
        "name": "glm",
        "base_url": "http://gw.internal:30000",
        "sglang_router": "http://gw.internal:30000",
        "probes": ["canary"],
        "tenants": [
            {"name": "alice", "api_key_env": "KVC_CRED_A"},
            {"name": "bob", "api_key_env": "KVC_CRED_B"},
        ],
        **fields,
    }


def test_credential_hosts_are_accepted_in_each_form() -> None:
    entries = [
        "gpu-7.internal",
        "gpu-8.internal:30000",
        "10.0.0.0/8",
        "fd00::/8",
        "[fd00::7]:8000",
        ".svc.cluster.local",
    ]
    settings = parse_settings({"targets": [target(credential_hosts=[f" {e} " for e in entries])]})
    [parsed] = settings.targets
    assert parsed.credential_hosts == entries
    assert parsed.credential_scope().allows("http://prefill-0.sglang.svc.cluster.local:30000/v1/completions")


@pytest.mark.parametrize(
    ("fields", "key", "why"),
    [
        (
            {"credential_hosts": ["10.0.0.0/8", "http://gpu-7:30000"]},
            "targets[0].credential_hosts[1]",
            "not a URL",
        ),
        ({"credential_hosts": ["0.0.0.0/0"]}, "targets[0].credential_hosts[0]", "every address"),
        ({"credential_hosts": ["*.internal"]}, "targets[0].credential_hosts[0]", "DNS suffix"),
        ({"credential_hosts": "10.0.0.0/8"}, "targets[0].credential_hosts", "list"),
        ({"worker_api_key": "sk-worker"}, "targets[0]", "worker_api_key: literal keys are refused"),
        ({"worker_api_key_env": "not a name"}, "targets[0].worker_api_key_env", "environment variable"),
        ({"worker_api_key_env": "KVC_CRED_A"}, "targets[0]", "tenant alice's key comes from KVC_CRED_A"),
        (
            {"nodes": [{"name": "p", "discovered": True}]},
            "targets[0].nodes[0]",
            "discovered: the monitor sets it",
        ),
        (
            {"nodes": [{"name": "p", "refuses_without_key": False}]},
            "targets[0].nodes[0]",
            "refuses_without_key",
        ),
    ],
)
def test_a_bad_credential_key_is_refused_naming_it(fields: dict[str, Any], key: str, why: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_settings({"targets": [target(**fields)]})
    assert re.search(re.escape(key) + r"(\.[a-z_]+)?: ", str(err.value)), str(err.value)
    assert why in str(err.value)


def test_the_worker_credential_is_read_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVC_CRED_A", "sk-alice-cred-0001")
    monkeypatch.setenv("KVC_CRED_B", "sk-bob-cred-0002")
    (tmp_path / "worker").write_text("sk-worker-cred-0009\n")
    from_file = parse_settings({"targets": [target(worker_api_key_file=str(tmp_path / "worker"))]})
    assert tenant_keys(from_file).workers == {"glm": "sk-worker-cred-0009"}
    assert ("glm", "worker") not in tenant_keys(from_file)  # the mapping holds tenants' keys only
    monkeypatch.setenv("KVC_CRED_W", "sk-worker-cred-0010")
    from_env = parse_settings({"targets": [target(worker_api_key_env="KVC_CRED_W")]})
    assert tenant_keys(from_env).workers == {"glm": "sk-worker-cred-0010"}
    assert tenant_keys(parse_settings({"targets": [target()]})).workers == {"glm": None}


def test_a_missing_or_shared_worker_credential_is_refused_without_showing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVC_CRED_A", "sk-alice-cred-0001")
    monkeypatch.setenv("KVC_CRED_B", "sk-bob-cred-0002")
    monkeypatch.delenv("KVC_CRED_UNSET", raising=False)
    unset = parse_settings({"targets": [target(worker_api_key_env="KVC_CRED_UNSET")]})
    with pytest.raises(ConfigError, match=r"targets\[0\]\.worker_api_key_env: .*KVC_CRED_UNSET is not set"):
        tenant_keys(unset)
    with pytest.raises(ConfigError, match=r"targets\[0\]\.worker_api_key_file: cannot read"):
        tenant_keys(parse_settings({"targets": [target(worker_api_key_file=str(tmp_path / "none"))]}))
    (tmp_path / "worker").write_text("sk-bob-cred-0002\n")  # bob's key, in the workers' file
    shared = parse_settings({"targets": [target(worker_api_key_file=str(tmp_path / "worker"))]})
    with pytest.raises(ConfigError) as err:
        tenant_keys(shared)
    assert "targets[0].worker_api_key_file: the worker credential is tenant bob's API key" in str(err.value)
    assert "sk-bob-cred-0002" not in str(err.value)


def test_the_cli_exits_2_naming_a_bad_credential_host(tmp_path: Path) -> None:
    config = {"api": {"local_only": True}, "targets": [target(credential_hosts=["10.0.0.1/8"])]}
    path = tmp_path / "kvcanary.yml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [sys.executable, "-m", "monitor", "check", "--config", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=os.environ,
        timeout=PROCESS_SECONDS,
    )
    assert proc.returncode == 2, proc.stderr
    assert "targets[0].credential_hosts[0]: '10.0.0.1/8': not a CIDR" in proc.stderr
    assert "Traceback" not in proc.stderr
