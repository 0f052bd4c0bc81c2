"""The config file: every bad file exits 2 with a message naming the key, through the real CLI."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvcanary.monitor.config.secrets import api_token, tenant_keys
from kvcanary.monitor.config.settings import ConfigError, load_settings, parse_settings
from kvcanary.probes import REGISTRY
from tests.support.pace import PROCESS_SECONDS

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "tests" / "fixtures" / "config"
INVALID = sorted(FIXTURES.glob("invalid-*.yml"))


def expected_key(path: Path) -> str:
    first = path.read_text(errors="replace").splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name} must say what it expects"
    return first.removeprefix("# expect: ")


def kvcanary(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "monitor", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=PROCESS_SECONDS,
    )


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_it_names_the_bad_key_of_each_invalid_file(path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert expected_key(path) in str(err.value)


@pytest.mark.parametrize("command", ["check", "serve"])
def test_the_cli_exits_2_naming_the_key(command: str) -> None:
    path = FIXTURES / "invalid-interval.yml"
    proc = kvcanary(command, "--config", str(path))
    assert proc.returncode == 2, proc.stderr
    assert "targets[0].interval_seconds" in proc.stderr
    assert "greater than 0" in proc.stderr


def test_the_cli_exits_2_for_a_missing_file(tmp_path: Path) -> None:
    proc = kvcanary("check", "--config", str(tmp_path / "nope.yml"))
    assert proc.returncode == 2
    assert "cannot read" in proc.stderr


@pytest.mark.parametrize(
    ("name", "key", "lines"),
    [
        ("invalid-duplicate-key-top.yml", "targets", (2, 7)),
        ("invalid-duplicate-key-target.yml", "targets[1].probes", (10, 12)),
    ],
)
def test_a_key_given_twice_is_refused_naming_its_path_and_both_lines(
    name: str, key: str, lines: tuple[int, int]
) -> None:
    """Plain YAML keeps the last one silently: a second ``targets:`` would drop the first list unseen."""
    with pytest.raises(ConfigError) as err:
        load_settings(FIXTURES / name)
    assert str(err.value) == f"{FIXTURES / name}: {key}: key given twice, at lines {lines[0]} and {lines[1]}"


def test_a_key_given_twice_deeper_is_named_by_its_dotted_path(tmp_path: Path) -> None:
    path = tmp_path / "kvcanary.yml"
    path.write_text("api:\n  listen: 127.0.0.1:8600\n  local_only: true\n  listen: 0.0.0.0:8600\n")
    with pytest.raises(ConfigError, match=re.escape("api.listen: key given twice, at lines 2 and 4")):
        load_settings(path)


def test_a_merged_key_stated_again_is_an_override_not_a_duplicate(tmp_path: Path) -> None:
    """Merge keys work as before: the mapping's own key wins over the merged one."""
    path = tmp_path / "kvcanary.yml"
    path.write_text(
        "targets:\n"
        "  - &base {name: a, base_url: 'http://127.0.0.1:1', tenants: [{name: x}], probes: [canary]}\n"
        "  - {<<: *base, name: b, probes: [canary, boundary]}\n"
    )
    a, b = load_settings(path).targets
    assert (a.name, a.probes) == ("a", ["canary"])
    assert (b.name, b.probes, b.base_url) == ("b", ["canary", "boundary"], a.base_url)


def test_merge_key_given_twice_is_refused(tmp_path: Path) -> None:
    """``<<`` is a key like any other: two mappings merge as ``<<: [*a, *b]``."""
    path = tmp_path / "kvcanary.yml"
    path.write_text("a: &a {x: 1}\nb: &b {y: 2}\napi:\n  <<: *a\n  <<: *b\n")
    with pytest.raises(ConfigError, match=re.escape("api.<<: key given twice, at lines 4 and 5")):
        load_settings(path)


@pytest.mark.parametrize("command", ["check", "serve"])
def test_the_cli_exits_2_naming_a_key_given_twice(command: str) -> None:
    proc = kvcanary(command, "--config", str(FIXTURES / "invalid-duplicate-key-target.yml"))
    assert proc.returncode == 2, proc.stderr
    assert "targets[1].probes: key given twice, at lines 10 and 12" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_annotated_example_is_valid() -> None:
    settings = load_settings(REPO / "kvcanary.example.yml")
    target = settings.targets[0]
    assert target.engine == "sglang"
    assert target.interval_for("boundary") == 300
    assert target.interval_for("canary") == 30


def test_every_option_the_example_shows_in_a_comment_is_accepted() -> None:
    """The commented ``kind: {...}`` lines are documentation: each must validate as written."""
    text = (REPO / "kvcanary.example.yml").read_text()
    shown = {
        m.group(1): yaml.safe_load(m.group(2))
        for m in re.finditer(r"^\s+# ([a-z_]+): (\{.*?\})", text, flags=re.M)
        if m.group(1) in REGISTRY
    }
    assert {"canary", "cross_tenant", "counters", "prefix_cache", "needle", "replay"} <= set(shown)
    config = yaml.safe_load(text)
    target = config["targets"][0]
    target["options"].update(shown)
    target["probes"] = sorted(set(target["probes"]) | set(shown))
    settings = parse_settings(config)
    assert settings.targets[0].options["cross_tenant"] == shown["cross_tenant"]


def test_a_named_but_unset_key_variable_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVC_TEST_UNSET", raising=False)
    settings = parse_settings(
        {
            "targets": [
                {
                    "name": "a",
                    "base_url": "http://127.0.0.1:1",
                    "probes": ["canary"],
                    "tenants": [{"name": "x", "api_key_env": "KVC_TEST_UNSET"}],
                }
            ]
        }
    )
    with pytest.raises(ConfigError, match=r"targets\[0\]\.tenants\[0\]\.api_key_env.*KVC_TEST_UNSET"):
        tenant_keys(settings)


def test_keys_come_from_files_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "k").write_text("file-key\n")
    monkeypatch.setenv("KVC_TEST_KEY", "env-key")
    settings = parse_settings(
        {
            "targets": [
                {
                    "name": "a",
                    "base_url": "http://127.0.0.1:1",
                    "probes": ["canary"],
                    "tenants": [
                        {"name": "x", "api_key_file": str(tmp_path / "k")},
                        {"name": "y", "api_key_env": "KVC_TEST_KEY"},
                        {"name": "z"},
                    ],
                }
            ]
        }
    )
    assert tenant_keys(settings) == {("a", "x"): "file-key", ("a", "y"): "env-key", ("a", "z"): None}


def test_the_api_needs_a_token_unless_local_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCANARY_API_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=r"api\.token_env"):
        api_token(parse_settings({}))
    assert api_token(parse_settings({"api": {"local_only": True}})) is None


def test_the_api_refuses_a_placeholder_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCANARY_API_TOKEN", "changeme")
    with pytest.raises(ConfigError, match="placeholder"):
        api_token(parse_settings({}))


def test_serve_exits_2_without_a_token(tmp_path: Path) -> None:
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump({"database_url": f"sqlite:///{tmp_path}/x.db", "targets": []}))
    env = {k: v for k, v in __import__("os").environ.items() if k != "KVCANARY_API_TOKEN"}
    proc = kvcanary("serve", "--config", str(config), env=env)
    assert proc.returncode == 2
    assert "api.token_env" in proc.stderr


def test_an_unusable_database_exits_2_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump({"database_url": "sqlite:////nonexistent/dir/x.db", "targets": []}))
    proc = kvcanary("db", "upgrade", "--config", str(config))
    assert proc.returncode == 2
    assert "database error" in proc.stderr and "Traceback" not in proc.stderr


def test_one_key_under_two_tenant_names_exits_2_naming_both(tmp_path: Path) -> None:
    """On main the same key under two names was accepted and cried leak on every run (3 of 3)."""
    config = {
        "api": {"local_only": True},
        "targets": [
            {
                "name": "glm",
                "base_url": "http://127.0.0.1:1",
                "probes": ["canary"],
                "tenants": [
                    {"name": "alice", "api_key_env": "KVC_A"},
                    {"name": "bob", "api_key_env": "KVC_B"},
                ],
            }
        ],
    }
    path = tmp_path / "kvcanary.yml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "KVC_A": "sk-same-key-0001", "KVC_B": "sk-same-key-0001"}
    for command in ("check", "serve"):
        proc = kvcanary(command, "--config", str(path), env=env)
        assert proc.returncode == 2, proc.stderr
        assert "alice and bob have the same API key" in proc.stderr
        assert "sk-same-key-0001" not in proc.stderr + proc.stdout


def test_a_database_url_that_does_not_parse_is_a_config_error_naming_it_and_hiding_the_password() -> None:
    with pytest.raises(ConfigError, match="database_url") as raised:
        parse_settings({"database_url": "postgresql+psycopg://u:s3cret-pw@host:notaport/db"})
    assert "s3cret-pw" not in str(raised.value)


def test_a_token_from_a_file_is_named_by_its_file_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVCANARY_API_TOKEN", raising=False)
    for text, why in (("changeme", "placeholder"), ("päss-wörd-0123456789", "printable ASCII")):
        (tmp_path / "token").write_text(text, encoding="utf-8")
        with pytest.raises(ConfigError, match=f"api.token_file: .*{why}"):
            api_token(parse_settings({"api": {"token_file": str(tmp_path / "token")}}))


def test_the_deprecated_single_node_role_reads_as_aggregated_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    target = {"name": "a", "base_url": "http://127.0.0.1:1", "tenants": [{"name": "x"}], "probes": ["canary"]}
    nodes = [{"name": "n0", "role": "single"}, {"name": "n1"}]
    with caplog.at_level("WARNING", logger="kvcanary.monitor.config.targets"):
        settings = parse_settings({"targets": [{**target, "nodes": nodes}]})
    assert [n.role for n in settings.targets[0].node_list()] == ["aggregated", "aggregated"]
    assert "role 'single' is deprecated" in caplog.text
    with pytest.raises(ConfigError, match=r"targets\[0\]\.nodes\[0\]\.role"):
        parse_settings({"targets": [{**target, "nodes": [{"name": "n0", "role": "solo"}]}]})


def test_a_nodes_log_page_is_its_own_url_or_the_targets_log_port_on_the_nodes_host() -> None:
    target = {"name": "a", "base_url": "http://gw.internal:30000", "tenants": [{"name": "x"}],
              "probes": ["counters"], "engine": "sglang"}  # fmt: skip
    nodes = [
        {"name": "p0", "role": "prefill", "info_url": "http://10.0.0.5:30001",
         "log_metrics_url": "http://logs.internal:9100/sglang/metrics"},
        {"name": "d0", "role": "decode", "info_url": "https://10.0.0.6:30002"},
    ]  # fmt: skip
    listed = parse_settings({"targets": [{**target, "nodes": nodes, "log_metrics_port": 3903}]}).targets[0]
    assert [n.log_metrics_url for n in listed.node_list()] == [
        "http://logs.internal:9100/sglang/metrics",
        "http://10.0.0.6:3903/metrics",
    ]
    alone = parse_settings({"targets": [{**target, "log_metrics_port": 3903}]}).targets[0]
    assert [n.log_metrics_url for n in alone.node_list()] == ["http://gw.internal:3903/metrics"]
    unset = parse_settings({"targets": [{**target, "nodes": nodes[1:]}]}).targets[0]
    assert [n.log_metrics_url for n in unset.node_list()] == [None]
    with pytest.raises(ConfigError, match=r"targets\[0\]\.log_metrics_port"):
        parse_settings({"targets": [{**target, "log_metrics_port": 0}]})
    with pytest.raises(ConfigError, match=r"targets\[0\]\.nodes\[0\]\.log_metrics_url"):
        bad = [{"name": "p0", "log_metrics_url": "http://user:pw@10.0.0.5:3903/metrics"}]
        parse_settings({"targets": [{**target, "nodes": bad}]})
