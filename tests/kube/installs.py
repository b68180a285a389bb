"""rawmm's own installs on the test cluster: the RLRun CRD alone, the Helm chart (helm-python-sdk) and
`manifests/install.yaml`. Tests share one cluster, so each install starts from and leaves no rawmm
objects: Helm adopts only objects it made, and the chart's CRD outlives `helm uninstall` by design
(helm.sh/resource-policy: keep)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import helm_python as helm

from kube.cluster import REPO, KubeCluster, wait_for

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


def ready_operator_pod(cluster: KubeCluster, timeout: float = 180) -> dict[str, Any]:
    """The release's operator pod once Ready (its startup and liveness probes); a timeout names what the pods,
    the namespace's events and the node said, since a pod that never gets Ready leaves no other trace."""

    def ready() -> dict[str, Any] | None:
        pods = json.loads(cluster.kubectl("get", "pods", "-n", RELEASE_NAMESPACE, "-o", "json").stdout)
        return next(
            (
                pod
                for pod in pods["items"]
                if any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in pod["status"].get("conditions", [])
                )
            ),
            None,
        )

    try:
        pod: dict[str, Any] = wait_for(ready, "the operator pod Ready", timeout=timeout, interval=0.5)
    except TimeoutError as timed_out:
        said = [
            cluster.kubectl(*args, check=False).stdout
            for args in (
                ("describe", "pods", "-n", RELEASE_NAMESPACE),
                ("logs", "-n", RELEASE_NAMESPACE, "-l", "app.kubernetes.io/component=operator", "--tail=40"),
                ("get", "events", "-n", RELEASE_NAMESPACE, "--sort-by=.lastTimestamp"),
                ("describe", "nodes"),
            )
        ]
        raise TimeoutError(f"{timed_out}\n" + "\n".join(said)) from None
    return pod
