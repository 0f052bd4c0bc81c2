"""``push_dashboards`` against a recording stand-in for Grafana's HTTP API (see grafana_stub.py)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcanary.monitor.commands.dashboards import (
    GrafanaRefusedError,
    PushConfigError,
    dashboard_files,
    panel_queries,
    push_dashboards,
    read_token,
    substitute,
)
from tests.dashboards.grafana_stub import GrafanaStub
from tests.support import free_port

TOKEN = "glsa_kvcanaryTestToken_0123456789abcdef"


@pytest.fixture
def grafana() -> Iterator[GrafanaStub]:
    stub = GrafanaStub(token=TOKEN).start()
    yield stub
    stub.stop()


@pytest.fixture(autouse=True)
def _every_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """Capture every logger at DEBUG (grafana-client, niquests, urllib3 included) to look for the token."""
    caplog.set_level(logging.DEBUG)


def assert_token_nowhere(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str], *more: str
) -> None:
    out, err = capsys.readouterr()
    for text in (caplog.text, out, err, *more):
        assert TOKEN not in text


def test_it_creates_the_folder_then_saves_each_dashboard_with_the_token(
    grafana: GrafanaStub, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    files = dashboard_files()
    results = push_dashboards(grafana.url, TOKEN, files, folder="kvcanary")

    assert [(r.method, r.path) for r in grafana.requests] == [
        ("GET", "/api/folders/kvcanary"),
        ("POST", "/api/folders"),
        *[("POST", "/api/dashboards/db")] * len(files),
    ]
    assert all(r.headers["Authorization"] == f"Bearer {TOKEN}" for r in grafana.requests)
    assert grafana.requests[1].body == {"title": "kvcanary", "uid": "kvcanary"}
    for request, path in zip(grafana.requests[2:], files, strict=True):
        assert request.headers["Content-Type"].startswith("application/json")
        assert request.body["dashboard"] == {**json.loads(path.read_text()), "id": None}  # matched by uid
        assert request.body["folderUid"] == "kvcanary"
        assert request.body["overwrite"] is True
        assert request.body["message"]
    assert [(r.uid, r.version, r.status) for r in results] == [
        ("kvcanary-overview", 1, "success"),
        ("kvcanary-workers", 1, "success"),
    ]
    assert results[0].url == f"{grafana.url}/d/kvcanary-overview/kvcanary-overview"
    assert_token_nowhere(caplog, capsys)


def test_a_second_push_reuses_the_folder_and_overwrites_the_same_uids(grafana: GrafanaStub) -> None:
    push_dashboards(grafana.url, TOKEN, dashboard_files())
    grafana.requests.clear()
    results = push_dashboards(grafana.url, TOKEN, dashboard_files())

    assert [(r.method, r.path) for r in grafana.requests] == [
        ("GET", "/api/folders/kvcanary"),
        ("POST", "/api/dashboards/db"),
        ("POST", "/api/dashboards/db"),
    ]
    assert [r.version for r in results] == [2, 2]
    assert sorted(grafana.dashboards) == ["kvcanary-overview", "kvcanary-workers"]


def test_without_overwrite_a_changed_dashboard_is_refused_with_412_naming_it(grafana: GrafanaStub) -> None:
    files = dashboard_files()
    push_dashboards(grafana.url, TOKEN, files)

    with pytest.raises(GrafanaRefusedError) as caught:
        push_dashboards(grafana.url, TOKEN, files, overwrite=False)

    error = caught.value
    assert (error.status, error.grafana_status, error.dashboard) == (
        412,
        "version-mismatch",
        "kvcanary-overview",
    )
    assert error.exit_code == 1
    assert "kvcanary-overview.json" in str(error) and "HTTP 412" in str(error)
    assert "The dashboard has been changed by someone else (version-mismatch)" in str(error)
    assert grafana.requests[-1].body["overwrite"] is False


def test_a_wrong_token_gets_401_and_an_error_that_does_not_repeat_it(
    grafana: GrafanaStub, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    grafana.token = "the-real-token"

    with pytest.raises(GrafanaRefusedError) as caught:
        push_dashboards(grafana.url, TOKEN, dashboard_files())

    assert caught.value.status == 401 and caught.value.dashboard is None
    assert str(caught.value) == f"Grafana at {grafana.url} refused folder 'kvcanary': HTTP 401: Unauthorized"
    assert [r.path for r in grafana.requests] == ["/api/folders/kvcanary"]  # stopped at once
    assert_token_nowhere(caplog, capsys, str(caught.value), repr(caught.value))


def test_a_grafana_that_does_not_answer_is_a_refusal_with_status_0(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(GrafanaRefusedError) as caught:
        push_dashboards(url, TOKEN, dashboard_files(), timeout=2)
    assert caught.value.status == 0 and caught.value.exit_code == 1
    assert f"Grafana at {url} refused folder 'kvcanary': no answer" in str(caught.value)
    assert_token_nowhere(caplog, capsys, str(caught.value))


def test_a_malformed_dashboard_file_is_refused_before_anything_is_sent(
    grafana: GrafanaStub, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text('{"title": "no uid"}')
    with pytest.raises(PushConfigError, match=r"broken\.json has no uid") as caught:
        push_dashboards(grafana.url, TOKEN, [*dashboard_files(), broken])
    assert caught.value.exit_code == 2
    assert grafana.requests == []


@pytest.mark.parametrize("url", ["grafana:3000", "ftp://grafana", "http://"])
def test_a_url_that_is_not_http_is_a_config_error(url: str) -> None:
    with pytest.raises(PushConfigError, match="--grafana-url"):
        push_dashboards(url, TOKEN, dashboard_files())


def test_the_token_comes_from_the_file_first_then_the_variable(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    environ = {"GRAFANA_TOKEN": "from-env"}
    assert read_token(token_env="GRAFANA_TOKEN", token_file=token_file, environ=environ) == TOKEN
    assert read_token(token_env="GRAFANA_TOKEN", environ=environ) == "from-env"


def test_a_missing_token_names_the_option_and_exits_2(tmp_path: Path) -> None:
    with pytest.raises(
        PushConfigError, match=r"^--token-env: environment variable KV_TOKEN is not set"
    ) as env:
        read_token(token_env="KV_TOKEN", environ={"KV_TOKEN": "  "})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(PushConfigError, match=r"^--token-file: .*empty is empty"):
        read_token(token_env="KV_TOKEN", token_file=empty, environ={})
    with pytest.raises(PushConfigError, match=r"^--token-file: cannot read"):
        read_token(token_env="KV_TOKEN", token_file=tmp_path / "absent", environ={})
    assert env.value.exit_code == 2


def test_panel_queries_fill_in_every_variable() -> None:
    queries = panel_queries()
    assert {uid for uid, _, _ in queries} == {"kvcanary-overview", "kvcanary-workers"}
    assert all("$" not in expr for _, _, expr in queries)
    assert substitute('rate(x{target=~"$target"}[$__rate_interval])') == 'rate(x{target=~".*"}[1m])'
    assert substitute('x{target=~"${target}"}[$__range]', {"target": "healthy"}) == 'x{target=~"healthy"}[1h]'
    leaks = [e for uid, title, e in panel_queries({"target": "defective"}) if title == "Leak verdicts"]
    selector = 'verdict="leak", target=~"defective", probe=~".*"'
    assert leaks == [f"round(sum(increase(kvcanary_probe_runs_total{{{selector}}}[1h])))"]
