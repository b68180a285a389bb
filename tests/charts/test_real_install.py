"""The chart and manifests/install.yaml installed for real (kube-apiserver, tests/kube), on a bare cluster and
on one with the prometheus-operator CRDs: every object is accepted and present, the monitoring objects only
where their API is served, and the installed CRD serves RLRuns."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from kube.cluster import KubeCluster
from kube.installs import (
    INSTALL_YAML,
    MONITORING_YAML,
    RELEASE_NAMESPACE,
    applied_install_yaml,
    helm_release,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
MONITORING_KINDS = {"ServiceMonitor", "PrometheusRule"}
WITH_AND_WITHOUT = pytest.mark.parametrize("monitoring", [False, True], ids=["bare", "prometheus-operator"])


def present_kinds(cluster: KubeCluster, manifest: str) -> set[str]:
    """The kinds of the manifest's objects, each read back from the server (fails if one is missing)."""
    listed = json.loads(cluster.kubectl("get", "-f", "-", "-o", "json", input=manifest).stdout)
    return {item["kind"] for item in listed["items"]}


def accepts_an_rlrun(cluster: KubeCluster) -> None:
    ns = cluster.namespace("install")
    cluster.kubectl("apply", "-n", ns, "-f", str(INSTALL_YAML.parent / "examples" / "tiny-cpu.yaml"))
    stored: dict[str, Any] = json.loads(
        cluster.kubectl("get", "rlrun", "tiny-cpu", "-n", ns, "-o", "json").stdout
    )
    assert stored["spec"]["inference"]["engine"] == "transformers"
    cluster.kubectl("delete", "namespace", ns, "--wait=false")


@WITH_AND_WITHOUT
def test_helm_install(kube_cluster: KubeCluster, monitoring: bool) -> None:
    kube_cluster.monitoring_crds(monitoring)
    with helm_release(kube_cluster) as release:
        assert release["status"] == "deployed", {k: v for k, v in release.items() if k != "manifest"}
        kinds = present_kinds(kube_cluster, release["manifest"])
        assert {
            "CustomResourceDefinition",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
        } <= kinds
        assert kinds & MONITORING_KINDS == (MONITORING_KINDS if monitoring else set())
        accepts_an_rlrun(kube_cluster)


@WITH_AND_WITHOUT
def test_kubectl_apply_install_yaml(kube_cluster: KubeCluster, monitoring: bool) -> None:
    kube_cluster.monitoring_crds(monitoring)
    with applied_install_yaml(kube_cluster, monitoring=monitoring):
        manifest = INSTALL_YAML.read_text() + ("\n---\n" + MONITORING_YAML.read_text() if monitoring else "")
        kinds = present_kinds(kube_cluster, manifest)
        assert {"Namespace", "CustomResourceDefinition", "ServiceAccount", "Deployment"} <= kinds
        assert kinds & MONITORING_KINDS == (MONITORING_KINDS if monitoring else set())
        assert not MONITORING_KINDS & {d["kind"] for d in yaml.safe_load_all(INSTALL_YAML.read_text()) if d}
        deployment = json.loads(
            kube_cluster.kubectl("get", "deployment", "-n", RELEASE_NAMESPACE, "-o", "json").stdout
        )["items"]
        assert len(deployment) == 1
        accepts_an_rlrun(kube_cluster)
