"""Every overlay of deploy/kubernetes/ renders with kubectl's own kustomize, its objects validate, and
what it deploys is the repository's: its rules, its dashboards, a configuration kvcanary accepts.

- Core objects against Kubernetes' JSON schemas (kubernetes-validate, strict: an unknown field is an
  error) for 1.30 and 1.37; the ServiceMonitor and PrometheusRule against the models
  cloudcoil-models-prometheus-operator generates from prometheus-operator's CRDs, read back whole
  (a field the CRD does not have is dropped by the model, and fails the comparison).
- Every PrometheusRule holds an alerts/*.rules.yml file's groups unchanged, every shipped alert is in
  them, and their rules pass ``promtool check rules`` and the repository's promtool unit tests.
- Secrets only by reference; the pods as the restricted Pod Security Standard asks.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from kvcanary.monitor.config.settings import parse_settings
from tests.alerts import ALERTS, RULE_FILES, TEST_FILES, require_tool
from tests.deploy import KUBERNETES, OVERLAYS, REPO, of_kind, one, render, render_warnings
from tests.support.pace import PROCESS_SECONDS

CORE_KINDS = {
    "Namespace", "ServiceAccount", "ConfigMap", "Service", "Deployment",
    "PodDisruptionBudget", "NetworkPolicy",
}  # fmt: skip
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
KUBERNETES_VERSIONS = ("1.30", "1.37")
SECRETS_MOUNT = "/var/run/secrets/kvcanary"
#: An environment variable whose name says it holds a secret must take it from a Secret.
SECRET_NAME = re.compile(r"TOKEN|KEY|PASSWORD|SECRET|CREDENTIAL", re.IGNORECASE)
VERSION = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE)[1]  # type: ignore[index]


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvcanary_k8s_generate", KUBERNETES / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pods(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in of_kind(objects, "Deployment")]


def settings_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """Return the kvcanary.yml the monitor's Deployment mounts, parsed."""
    deployment = one(objects, "Deployment", "kvcanary")
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    config = one(objects, "ConfigMap", volume["configMap"]["name"])
    loaded: dict[str, Any] = yaml.safe_load(config["data"]["kvcanary.yml"])
    return loaded


# --- one source of truth ------------------------------------------------------------------------------


def test_the_generated_folder_is_what_generate_py_writes() -> None:
    run = subprocess.run(
        [sys.executable, str(KUBERNETES / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=PROCESS_SECONDS,
    )
    assert run.returncode == 0, run.stderr


def test_generate_check_names_a_stale_or_stray_file_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    generator = load_generator()
    generator.GENERATED = tmp_path / "generated"
    generator.REPO = tmp_path  # names are printed relative to it
    (tmp_path / "alerts").symlink_to(REPO / "alerts")
    (tmp_path / "dashboards").symlink_to(REPO / "dashboards")
    assert generator.main([]) == 0 and generator.main(["--check"]) == 0
    rule = generator.GENERATED / "prometheusrule-kvcanary.yaml"
    rule.write_text(rule.read_text().replace("severity: critical", "severity: warning", 1))
    (generator.GENERATED / "stray.yaml").write_text("kind: ConfigMap\n")
    assert generator.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "generated/prometheusrule-kvcanary.yaml" in err and "generated/stray.yaml" in err
    assert generator.main([]) == 0 and generator.main(["--check"]) == 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rule_file_is_a_prometheus_rule_with_its_groups_unchanged(overlay: str) -> None:
    rules = of_kind(render(overlay), "PrometheusRule")
    by_name = {r["metadata"]["name"]: r["spec"]["groups"] for r in rules}
    expected = {
        path.name.removesuffix(".rules.yml").replace(".", "-"): yaml.safe_load(path.read_text())["groups"]
        for path in RULE_FILES
    }
    assert by_name == expected
    shipped = {r["alert"] for groups in by_name.values() for g in groups for r in g["rules"] if "alert" in r}
    assert (
        shipped == ALERTS and "KVCanaryLeakDetected" in shipped and "KVCanaryCorrectnessBudgetBurn" in shipped
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_prometheus_rules_pass_promtool(overlay: str, tmp_path: Path) -> None:
    """Check the rendered rules with every lint fatal, and run the repository's unit tests on them
    (the SLO file's are left out: the groups are the same as the file's, shown above, and its
    three-day histories take promtool half a minute)."""
    promtool = require_tool("promtool")
    for rule in of_kind(render(overlay), "PrometheusRule"):
        name = next(p.name for p in RULE_FILES if p.name.removesuffix(".rules.yml").replace(".", "-")
                    == rule["metadata"]["name"])  # fmt: skip
        (tmp_path / name).write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    files = sorted(str(p) for p in tmp_path.glob("*.rules.yml"))
    assert len(files) == len(RULE_FILES)
    run = subprocess.run([promtool, "check", "rules", "--lint=all", "--lint-fatal", *files],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    (tmp_path / "tests").mkdir()
    tests = [p for p in TEST_FILES if p.name != "slo.test.yml"]
    for path in tests:
        shutil.copy(path, tmp_path / "tests" / path.name)
    run = subprocess.run([promtool, "test", "rules", *(str(tmp_path / "tests" / p.name) for p in tests)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_dashboard_is_a_configmap_for_grafanas_sidecar(overlay: str) -> None:
    maps = [
        m
        for m in of_kind(render(overlay), "ConfigMap")
        if m["metadata"].get("labels", {}).get("grafana_dashboard")
    ]
    found = {name: text for m in maps for name, text in m["data"].items()}
    assert found == {p.name: p.read_text(encoding="utf-8") for p in (REPO / "dashboards").glob("*.json")}
    for m in maps:
        assert m["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert m["metadata"]["annotations"]["grafana_folder"] == "kvcanary"
        for text in m["data"].values():
            assert json.loads(text)["uid"].startswith("kvcanary-")


# --- the overlays render and validate -----------------------------------------------------------------


def test_there_are_a_production_and_a_try_overlay() -> None:
    assert {"production", "try"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_without_a_warning(overlay: str) -> None:
    objects = render(overlay)
    assert {"Deployment", "Service", "ServiceMonitor", "PrometheusRule", "NetworkPolicy"} <= {
        o["kind"] for o in objects
    }
    assert render_warnings(overlay).strip() == ""


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_core_object_validates_against_kubernetes_schemas(overlay: str, version: str) -> None:
    import kubernetes_validate

    objects = render(overlay)
    assert {o["kind"] for o in objects} <= CORE_KINDS | CRD_KINDS, "a kind neither validation covers"
    for obj in objects:
        if obj["kind"] in CORE_KINDS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = f"{obj['kind']}/{obj['metadata']['name']} ({version})"
                pytest.fail(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_servicemonitors_and_prometheusrules_validate_against_the_operators_crds(overlay: str) -> None:
    from cloudcoil.models.prometheus_operator import v1

    models = {"ServiceMonitor": v1.ServiceMonitor, "PrometheusRule": v1.PrometheusRule}
    for obj in (o for o in render(overlay) if o["kind"] in CRD_KINDS):
        parsed = models[obj["kind"]].model_validate(obj)
        back = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
        assert back == obj, f"{obj['kind']}/{obj['metadata']['name']}: a field the CRD does not have"


def test_the_crd_check_refuses_a_misspelt_field() -> None:
    from cloudcoil.models.prometheus_operator import v1

    monitor = one(render(OVERLAYS[0]), "ServiceMonitor", "kvcanary")
    monitor = json.loads(json.dumps(monitor))
    monitor["spec"]["endpoints"][0]["intervall"] = monitor["spec"]["endpoints"][0].pop("interval")
    back = v1.ServiceMonitor.model_validate(monitor).model_dump(
        by_alias=True, exclude_unset=True, mode="json"
    )
    assert back != monitor


# --- what the overlays run ----------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_configuration_is_one_kvcanary_accepts_with_secrets_in_files_only(overlay: str) -> None:
    data = settings_of(render(overlay))
    settings = parse_settings(data, source=overlay)
    assert settings.api.listen.startswith("0.0.0.0:") and settings.api.token_file is not None
    files = re.findall(r"_file: (\S+)", yaml.safe_dump(data))
    assert files and all(f.startswith(SECRETS_MOUNT + "/") for f in files), files
    assert settings.targets and all(t.tenants for t in settings.targets)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_are_referenced_never_written(overlay: str) -> None:
    objects = render(overlay)
    assert of_kind(objects, "Secret") == []
    for name, pod in pods(objects):
        for container in pod.get("initContainers", []) + pod["containers"]:
            for env in container.get("env", []):
                if SECRET_NAME.search(env["name"]):
                    assert "value" not in env and "secretKeyRef" in env["valueFrom"], (name, env)
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] == "kvcanary", (name, volume)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_runs_as_the_restricted_standard_asks(overlay: str) -> None:
    objects = render(overlay)
    for name, pod in pods(objects):
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        assert pod["automountServiceAccountToken"] is False, name
        for container in pod.get("initContainers", []) + pod["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, (name, container["name"])
            assert context["allowPrivilegeEscalation"] is False, (name, container["name"])
            assert context["capabilities"]["drop"] == ["ALL"], (name, container["name"])
            assert {"cpu", "memory"} <= container["resources"]["requests"].keys(), (name, container["name"])
            assert "memory" in container["resources"]["limits"], (name, container["name"])
    for namespace in of_kind(objects, "Namespace"):
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_monitor_is_probed_migrated_scraped_reachable_and_disruptable(overlay: str) -> None:
    objects = render(overlay)
    deployment = one(objects, "Deployment", "kvcanary")
    pod = deployment["spec"]["template"]["spec"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    container = next(c for c in pod["containers"] if c["name"] == "kvcanary")
    assert container["args"][:1] == ["serve"]
    assert [c["args"][:2] for c in pod["initContainers"]] == [["db", "upgrade"]]
    # Readiness follows the database; liveness must not (a database outage restarts nothing).
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["livenessProbe"]["httpGet"]["path"] == container["startupProbe"]["httpGet"]["path"]
    assert container["livenessProbe"]["httpGet"]["path"] != "/healthz"
    port = next(p for p in container["ports"] if p["name"] == "http")
    service = one(objects, "Service", "kvcanary")
    assert service["spec"]["selector"].items() <= labels.items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    monitor = one(objects, "ServiceMonitor", "kvcanary")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    policy = one(objects, "NetworkPolicy", "kvcanary")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]} == {port["name"]}
    budget = one(objects, "PodDisruptionBudget", "kvcanary")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"].get("maxUnavailable") == 1, "a budget one replica cannot meet blocks every drain"
    namespace = of_kind(objects, "Namespace")[0]["metadata"]["name"]
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {namespace}


def test_production_runs_replicas_on_postgresql_and_jetstream() -> None:
    objects = render("production")
    settings = parse_settings(settings_of(objects))
    assert one(objects, "Deployment", "kvcanary")["spec"]["replicas"] >= 2
    assert settings.database_url.startswith("postgresql+psycopg://") and "@" in settings.database_url
    assert ":" not in settings.database_url.split("//", 1)[1].split("@", 1)[0], "a password in the URL"
    assert settings.traffic.source == "jetstream" and settings.alertmanagers
    pod = one(objects, "Deployment", "kvcanary")["spec"]["template"]["spec"]
    for container in pod["initContainers"] + pod["containers"]:
        assert "PGPASSWORD" in {e["name"] for e in container["env"]}, container["name"]


def test_try_runs_one_replica_on_sqlite_probing_the_reference_worker_beside_it() -> None:
    objects = render("try")
    settings = parse_settings(settings_of(objects))
    assert one(objects, "Deployment", "kvcanary")["spec"]["replicas"] == 1
    assert settings.database_url.startswith("sqlite:////var/lib/kvcanary/")
    (target,) = settings.targets
    worker = one(objects, "Service", "kvcanary-worker")
    assert target.engine == "reference"
    assert target.base_url == f"http://{worker['metadata']['name']}:{worker['spec']['ports'][0]['port']}"
    scrape = one(objects, "ServiceMonitor", "kvcanary-worker")
    relabel = scrape["spec"]["endpoints"][0]["relabelings"][0]
    assert (relabel["targetLabel"], relabel["replacement"]) == ("target", target.name)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_images_are_those_deploy_build_image_sh_tags(overlay: str) -> None:
    script = (REPO / "deploy" / "build-image.sh").read_text()
    containerfile = (REPO / "deploy" / "Containerfile").read_text()
    assert "tag=${1:-localhost/$name:$version}" in script
    users = set(re.findall(r"^USER (\d+):", containerfile, re.MULTILINE))
    for name, pod in pods(render(overlay)):
        for container in pod.get("initContainers", []) + pod["containers"]:
            assert container["image"] in {
                f"localhost/kvcanary:{VERSION}",
                f"localhost/kvcanary-worker:{VERSION}",
            }
        assert {str(pod["securityContext"]["runAsUser"])} == users, name
