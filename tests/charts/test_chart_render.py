"""The chart rendered offline with Helm's Go SDK: every object is valid Kubernetes, and the values do what
values.yaml says they do."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import helm_python as helm
import pytest
from chart_generate import load_generate
from chart_helpers import KUBE_VERSIONS, read_values, validate_object, values_files

generate = load_generate()
RELEASE_NAMESPACE = "rawmm-system"
VALUE_SETS = {"defaults": None, **{path.stem: read_values(path) for path in values_files()}}


@cache
def _render(values_name: str) -> tuple[Any, ...]:
    return tuple(generate.render_chart(VALUE_SETS[values_name], release="rawmm", namespace=RELEASE_NAMESPACE))


def render(values: dict[str, Any] | None = None) -> list[Any]:
    return generate.render_chart(values, release="rawmm", namespace=RELEASE_NAMESPACE)


def by_kind(docs: Any, kind: str) -> list[dict[str, Any]]:
    return [doc.body for doc in docs if doc.kind == kind]


def one(docs: Any, kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values_name", sorted(VALUE_SETS))
def test_every_rendered_object_validates_strictly(values_name: str, kube_version: str) -> None:
    docs = _render(values_name)
    assert docs
    for doc in docs:
        validate_object(doc.body, kube_version)


@pytest.mark.parametrize("values_name", sorted(VALUE_SETS))
def test_objects_are_unique_and_namespaced_in_the_release(values_name: str) -> None:
    docs = _render(values_name)
    keys = [(doc.kind, doc.body["metadata"].get("namespace"), doc.name) for doc in docs]
    assert len(keys) == len(set(keys))
    cluster_scoped = {"CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}
    for doc in docs:
        namespace = doc.body["metadata"].get("namespace")
        assert (namespace is None) == (doc.kind in cluster_scoped), (doc.kind, doc.name)


def test_operator_deployment_is_one_hardened_replica() -> None:
    docs = _render("defaults")
    deployment = one(docs, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    port_names = {port["name"] for port in container["ports"]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] in port_names
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]


def test_operator_image_defaults_to_app_version_and_follows_values() -> None:
    chart = generate.yaml.safe_load((generate.CHART_DIR / "Chart.yaml").read_text())
    (container,) = one(_render("defaults"), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"ghcr.io/rawmm/rawmm-operator:{chart['appVersion']}"
    (container,) = one(_render("customized"), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example.com/ml/rawmm-operator:0.1.0-patched"
    assert container["imagePullPolicy"] == "Always"


def test_operator_watches_all_namespaces_by_default_and_only_the_listed_ones_otherwise() -> None:
    def args(values_name: str) -> list[str]:
        return one(_render(values_name), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]

    assert "--all-namespaces" in args("defaults")
    assert not any(a.startswith("--namespace") for a in args("defaults"))
    namespaced = args("namespaced")
    assert "--all-namespaces" not in namespaced
    assert [a for a in namespaced if a.startswith("--namespace")] == [
        "--namespace=ml-research",
        "--namespace=ml-prod",
    ]


def test_scheduling_and_pod_metadata_values_reach_the_pod() -> None:
    values = VALUE_SETS["customized"]["operator"]
    template = one(_render("customized"), "Deployment")["spec"]["template"]
    pod = template["spec"]
    assert pod["nodeSelector"] == values["nodeSelector"]
    assert pod["tolerations"] == values["tolerations"]
    assert pod["affinity"] == values["affinity"]
    assert pod["priorityClassName"] == values["priorityClassName"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert template["metadata"]["annotations"] == values["podAnnotations"]
    assert template["metadata"]["labels"]["team"] == "ml-infra"
    assert pod["containers"][0]["resources"] == values["resources"]


def test_existing_service_account_is_used_not_created() -> None:
    docs = _render("customized")
    assert not by_kind(docs, "ServiceAccount")
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "existing-operator-sa"
    for binding in by_kind(docs, "ClusterRoleBinding") + by_kind(docs, "RoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "existing-operator-sa", "namespace": RELEASE_NAMESPACE}
        ]


def test_fullname_override_names_every_object() -> None:
    for doc in _render("customized"):
        if doc.kind != "CustomResourceDefinition":
            assert doc.name.startswith("mm-operator"), (doc.kind, doc.name)


def test_metrics_service_selects_the_operator_pod_and_the_service_monitor_selects_the_service() -> None:
    docs = _render("defaults")
    deployment = one(docs, "Deployment")
    service = one(docs, "Service")
    monitor = one(docs, "ServiceMonitor")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    container_ports = {p["name"]: p for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert port["targetPort"] in container_ports
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [port["name"]]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [RELEASE_NAMESPACE]}
    customized = one(_render("customized"), "ServiceMonitor")
    assert customized["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert customized["spec"]["endpoints"][0]["interval"] == "15s"


def test_toggles_remove_their_objects() -> None:
    kinds = {doc.kind for doc in _render("minimal")}
    assert kinds.isdisjoint({"CustomResourceDefinition", "ServiceMonitor", "PrometheusRule", "ConfigMap"})
    assert {"Deployment", "ServiceAccount", "ClusterRole", "Service"} <= kinds
    defaults = {doc.kind for doc in _render("defaults")}
    assert {"CustomResourceDefinition", "ServiceMonitor", "PrometheusRule", "ConfigMap"} <= defaults


def test_crd_is_kept_on_uninstall_unless_told_otherwise() -> None:
    kept = one(_render("defaults"), "CustomResourceDefinition")
    assert kept["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    not_kept = one(_render("customized"), "CustomResourceDefinition")
    assert "helm.sh/resource-policy" not in not_kept["metadata"].get("annotations", {})


def test_chart_crd_is_the_operators_crd() -> None:
    from rawmm_operator.crd import crd_manifest

    source = crd_manifest()
    for values_name in ("defaults", "customized"):
        rendered = one(_render(values_name), "CustomResourceDefinition")
        assert rendered["spec"] == source["spec"]
        assert rendered["metadata"]["name"] == source["metadata"]["name"]
        assert source["metadata"].get("labels", {}).items() <= rendered["metadata"]["labels"].items()


def test_dashboards_are_labelled_configmaps_holding_each_dashboard() -> None:
    dashboards = {
        path.name: json.loads(path.read_text()) for path in (generate.CHART_DIR / "dashboards").glob("*.json")
    }
    assert set(dashboards) == {"materialization.json", "rl-run.json", "operator.json"}
    config_maps = by_kind(_render("defaults"), "ConfigMap")
    shipped = {}
    for config_map in config_maps:
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["metadata"]["namespace"] == RELEASE_NAMESPACE
        ((key, text),) = config_map["data"].items()
        shipped[key.removeprefix("rawmm-")] = json.loads(text)
    assert shipped == dashboards
    customized = by_kind(_render("customized"), "ConfigMap")
    assert {cm["metadata"]["namespace"] for cm in customized} == {"monitoring"}
    assert all(cm["metadata"]["annotations"] == {"grafana_folder": "rawmm"} for cm in customized)


def test_prometheus_rule_carries_every_alert_and_the_values_thresholds() -> None:
    rule = one(_render("customized"), "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rules = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}
    assert set(rules) == {
        "RawmmInvalidImageRefs",
        "RawmmMaterializeCacheHitRateLow",
        "RawmmRLRunFailed",
        "RawmmTrainerStalled",
        "RawmmEngineDown",
        "RawmmOffloadVolumeNearlyFull",
    }
    hit_rate = rules["RawmmMaterializeCacheHitRateLow"]
    assert "< 0.7" in hit_rate["expr"] and "> 1" in hit_rate["expr"]
    assert hit_rate["for"] == "30m" and hit_rate["labels"]["severity"] == "critical"
    for alert in rules.values():
        assert alert["annotations"]["summary"] and alert["annotations"]["description"]


def test_namespaced_install_binds_the_operator_role_only_in_watched_namespaces() -> None:
    docs = _render("namespaced")
    role_bindings = by_kind(docs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in role_bindings) == ["ml-prod", "ml-research"]
    operator_role = next(r for r in by_kind(docs, "ClusterRole") if r["metadata"]["name"] == "rawmm-operator")
    assert all(b["roleRef"]["name"] == operator_role["metadata"]["name"] for b in role_bindings)
    # The only cluster-wide binding is the framework's (CRD discovery, namespace listing).
    cluster_bindings = by_kind(docs, "ClusterRoleBinding")
    assert [b["roleRef"]["name"] for b in cluster_bindings] == ["rawmm-operator-cluster"]
    framework = next(
        r for r in by_kind(docs, "ClusterRole") if r["metadata"]["name"] == "rawmm-operator-cluster"
    )
    assert {"namespaces"} <= {res for rule in framework["rules"] for res in rule["resources"]}


@pytest.mark.parametrize("values_name", sorted(VALUE_SETS))
def test_operator_command_line_is_what_rawmm_operator_accepts(
    values_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from rawmm.commands import operator as operator_command

    with helm.Chart.load(generate.CHART_DIR) as chart:
        values = chart.merge_values(VALUE_SETS[values_name])
    (container,) = one(_render(values_name), "Deployment")["spec"]["template"]["spec"]["containers"]
    command, *arguments = container["args"]
    assert command == "operator"
    for variable in container["env"]:
        monkeypatch.setenv(variable["name"], variable["value"])  # read by the parser's defaults
    parser = argparse.ArgumentParser()
    operator_command.add_arguments(parser)
    parsed = parser.parse_args(arguments)
    settings = values["operator"]
    assert parsed.namespace == settings["watchNamespaces"]
    assert parsed.all_namespaces == (not settings["watchNamespaces"])
    assert (parsed.liveness_port, parsed.metrics_port) == (settings["healthPort"], settings["metricsPort"])
    assert parsed.verbose == settings["verbose"]
    pod_monitor = values["runs"]["podMonitor"]
    assert parsed.pod_monitor == str(pod_monitor["enabled"]).lower()
    assert parsed.pod_monitor_interval == pod_monitor["interval"]
    assert json.loads(parsed.pod_monitor_labels) == pod_monitor["labels"]
