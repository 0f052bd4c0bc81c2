"""``kvcanary dashboards push``: exit codes, messages, and a token that never shows.

These run once the command is wired into ``monitor/commands/cli.py``; until then they skip.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from tests.dashboards.grafana_stub import GrafanaStub

TOKEN = "glsa_cliTestToken_fedcba9876543210"


@pytest.fixture
def kvcanary() -> typer.Typer:
    from kvcanary.monitor.commands import cli

    # The command is part of the CLI's contract: its absence is a failure, not a reason to skip.
    assert "dashboards" in typer.main.get_command(cli.app).commands, "kvcanary dashboards is missing"  # type: ignore[attr-defined]
    return cli.app


@pytest.fixture
def grafana() -> Iterator[GrafanaStub]:
    stub = GrafanaStub(token=TOKEN).start()
    yield stub
    stub.stop()


def push(app: typer.Typer, *args: str, env: dict[str, str | None] | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(
        app, ["dashboards", "push", *args], env={"GRAFANA_TOKEN": None, **(env or {})}
    )
    return result.exit_code, result.stdout, result.stderr


def test_it_pushes_every_dashboard_and_prints_where(kvcanary: typer.Typer, grafana: GrafanaStub) -> None:
    code, out, err = push(
        kvcanary, "--grafana-url", grafana.url, "--token-env", "KV_TOKEN", env={"KV_TOKEN": TOKEN}
    )
    assert code == 0, err
    assert f"kvcanary-overview: version 1, {grafana.url}/d/kvcanary-overview/" in out
    assert "kvcanary-workers: version 1" in out
    assert TOKEN not in out + err


def test_an_unset_token_variable_exits_2_naming_the_option(
    kvcanary: typer.Typer, grafana: GrafanaStub
) -> None:
    code, _, err = push(
        kvcanary, "--grafana-url", grafana.url, "--token-env", "KV_TOKEN", env={"KV_TOKEN": None}
    )
    assert code == 2
    assert "--token-env: environment variable KV_TOKEN is not set" in err
    assert grafana.requests == []


def test_a_token_file_wins_over_the_variable(
    kvcanary: typer.Typer, grafana: GrafanaStub, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    code, _, err = push(kvcanary, "--grafana-url", grafana.url, "--token-file", str(token_file))
    assert code == 0, err
    assert grafana.requests[0].headers["Authorization"] == f"Bearer {TOKEN}"


def test_a_refusal_exits_1_with_grafanas_message(kvcanary: typer.Typer, grafana: GrafanaStub) -> None:
    grafana.token = "another-token"
    code, out, err = push(kvcanary, "--grafana-url", grafana.url, env={"GRAFANA_TOKEN": TOKEN})
    assert code == 1
    assert f"kvcanary: Grafana at {grafana.url} refused folder 'kvcanary': HTTP 401: Unauthorized" in err
    assert TOKEN not in out + err
