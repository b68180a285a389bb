"""A namespaced install (operator.watchNamespaces) on kube-apiserver: the operator, running as the chart's
ServiceAccount and watching one namespace, takes a run to Succeeded with no request denied and none outside
that namespace, and the same account may touch nothing in another namespace. An install without PodMonitors
reconciles with no request denied too."""

from __future__ import annotations

import pytest
from kube.cluster import KubeCluster
from real_runs import SPEC, Run, installed_chart, remove_runs

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_a_namespaced_install_reconciles_its_namespace_only(kube_cluster: KubeCluster) -> None:
    watched, other = kube_cluster.namespace("watched"), kube_cluster.namespace("other")
    run = Run(kube_cluster, watched)
    with installed_chart(kube_cluster, {"operator": {"watchNamespaces": [watched]}}) as chart:
        offset = kube_cluster.audit_log.stat().st_size
        with kube_cluster.operator(chart.kubeconfig, namespace=watched) as operator:
            run.create(SPEC)
            run.wait_running(operator)
            run.finish("orchestrator", 0)
            run.finish("trainer", 0)
            run.wait_phase("Succeeded", operator)
        events = kube_cluster.audit_events(chart.user, since=offset)
        denied = sorted({(e["verb"], e["requestURI"]) for e in events if e["responseStatus"]["code"] == 403})
        assert not denied, denied
        namespaces = {e["objectRef"].get("namespace") for e in events if e.get("objectRef")}
        assert namespaces <= {watched, None}, namespaces  # None: the CRD and namespace lists kopf makes
        elsewhere = kube_cluster.kubectl(
            "get", "statefulsets", "-n", other, kubeconfig=chart.kubeconfig, check=False
        )
        assert elsewhere.returncode != 0 and "forbidden" in elsewhere.stderr
    for namespace in (watched, other):
        remove_runs(kube_cluster, namespace)


def test_an_install_without_pod_monitors_reconciles_with_no_request_denied(kube_cluster: KubeCluster) -> None:
    """`runs.podMonitor.enabled=false` grants no right on PodMonitors (the CRD may be served anyway): the
    operator must not even list them, or every pass fails and the run's status is never written."""
    namespace = kube_cluster.namespace("no-monitors")
    run = Run(kube_cluster, namespace)
    with installed_chart(kube_cluster, {"runs": {"podMonitor": {"enabled": False}}}) as chart:
        offset = kube_cluster.audit_log.stat().st_size
        # What the chart's Deployment passes it (RAWMM_POD_MONITOR): the operator runs here, not in a pod.
        with kube_cluster.operator(chart.kubeconfig, env={"RAWMM_POD_MONITOR": "false"}) as operator:
            run.create(SPEC)
            run.wait_phase("Running", operator)  # the status is written: the passes go through
        assert not [key for key in run.children() if key[0] == "PodMonitor"]
        events = kube_cluster.audit_events(chart.user, since=offset)
        denied = sorted({(e["verb"], e["requestURI"]) for e in events if e["responseStatus"]["code"] == 403})
        assert not denied, denied
    remove_runs(kube_cluster, namespace)
