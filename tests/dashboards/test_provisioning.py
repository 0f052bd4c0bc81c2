"""The provisioning files agree with the dashboards, and the README lists every panel."""

from __future__ import annotations

import re
from typing import Any

import yaml

from kvcanary.monitor.commands.dashboards import DASHBOARDS_DIR
from tests.support.dashboards import all_panels

PROVISIONING = DASHBOARDS_DIR / "provisioning"


def test_the_dashboard_provider_loads_the_json_folder_into_the_kvcanary_folder() -> None:
    config = yaml.safe_load((PROVISIONING / "dashboards.yml").read_text())
    assert config["apiVersion"] == 1
    (provider,) = config["providers"]
    assert provider["type"] == "file"
    assert (provider["folder"], provider["folderUid"]) == ("kvcanary", "kvcanary")  # push's default too
    assert provider["options"]["path"].startswith("/")
    assert provider["options"]["foldersFromFilesStructure"] is False


def test_the_datasource_has_the_uid_the_dashboards_default_to_and_an_env_url(
    dashboards: dict[str, dict[str, Any]],
) -> None:
    config = yaml.safe_load((PROVISIONING / "datasources.yml").read_text())
    (source,) = config["datasources"]
    assert (source["uid"], source["type"], source["access"]) == ("prometheus", "prometheus", "proxy")
    for model in dashboards.values():
        (variable,) = [v for v in model["templating"]["list"] if v["name"] == "datasource"]
        assert variable["current"]["value"] == source["uid"]
    # Grafana expands only $VAR and ${VAR} (Go's os.ExpandEnv): ${VAR:-x} would become "".
    assert re.fullmatch(r"\$\{?KVCANARY_PROMETHEUS_URL\}?", source["url"])


def test_the_readme_names_every_dashboard_and_panel(dashboards: dict[str, dict[str, Any]]) -> None:
    readme = (DASHBOARDS_DIR / "README.md").read_text()
    for name, model in dashboards.items():
        assert name in readme and model["uid"] in readme
        for panel in all_panels(model["panels"]):
            assert panel["title"] in readme, f"README.md does not mention panel {panel['title']!r}"
