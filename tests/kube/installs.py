"""rawmm's own installs on the test cluster: the RLRun CRD alone, the Helm chart (helm-python-sdk) and
`manifests/install.yaml`. Tests share one cluster, so each install starts from and leaves no rawmm
objects: Helm adopts only objects it made, and the chart's CRD outlives `helm uninstall` by design
(helm.sh/resource-policy: keep)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import helm_python as helm

from kube.cluster import REPO, KubeCluster

CHART = REPO / "charts" / "rawmm"
CRD_FILE = REPO / "manifests" / "crds" / "rlruns.rawmm.dev.yaml"
CRD = "crd/rlruns.rawmm.dev"
INSTALL_YAML = REPO / "manifests" / "install.yaml"
MONITORING_YAML = REPO / "manifests" / "monitoring.yaml"
RELEASE, RELEASE_NAMESPACE = "rawmm", "rawmm-system"  # as install.yaml is rendered


def apply_crd(cluster: KubeCluster) -> None:
    """The RLRun CRD as `rawmm manifests` writes it, Established (idempotent; takes over a chart's copy)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", f"--filename={CRD_FILE}")
    cluster.wait_established(CRD)


def remove_crd(cluster: KubeCluster) -> None:
    """Delete the CRD and, with it, every RLRun (and through owner references their children)."""
    cluster.kubectl("delete", CRD, "--ignore-not-found", "--wait", "--timeout=120s")


def remove_namespace(cluster: KubeCluster, namespace: str) -> None:
    cluster.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait", "--timeout=120s")


@contextlib.contextmanager
def helm_release(
    cluster: KubeCluster, values: dict[str, Any] | None = None, *, release: str = RELEASE
) -> Iterator[dict[str, Any]]:
    """`helm install <release> charts/rawmm -n rawmm-system --create-namespace`; yields the release
    (its `manifest` is what Helm created); uninstalls it, its kept CRD and the namespace on exit."""
    remove_crd(cluster)
    with helm.Config(kubeconfig_path=str(cluster.kubeconfig), namespace=RELEASE_NAMESPACE) as config:
        installed = config.install(
            CHART, release, values or {}, namespace=RELEASE_NAMESPACE, create_namespace=True
        )
        try:
            yield installed
        finally:
            config.uninstall(release)
            remove_crd(cluster)
            remove_namespace(cluster, RELEASE_NAMESPACE)


@contextlib.contextmanager
def applied_install_yaml(cluster: KubeCluster, *, monitoring: bool) -> Iterator[None]:
    """`kubectl apply -f manifests/install.yaml` (and monitoring.yaml when `monitoring`), as the README
    says; deletes what it created on exit."""
    files = [INSTALL_YAML, *([MONITORING_YAML] if monitoring else [])]
    arguments = [f"--filename={f}" for f in files]
    remove_crd(cluster)
    try:
        cluster.kubectl("apply", *arguments)
        yield
    finally:
        cluster.kubectl("delete", "--ignore-not-found", "--wait", "--timeout=120s", *arguments, check=False)
        remove_crd(cluster)
        remove_namespace(cluster, RELEASE_NAMESPACE)
