"""The test control plane itself (tests/kube/cluster.py): what the operator and chart tests rely on."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from kube.cluster import NODES, KubeCluster, wait_for

pytestmark = pytest.mark.cluster


def job(name: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name},
            "spec": {
                "backoffLimit": 0,
                "template": {
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [
                            {
                                "name": "main",
                                "image": "example.invalid/never-pulled",
                                "resources": {"limits": {"nvidia.com/gpu": "2"}},
                            }
                        ],
                    }
                },
            },
        }
    )


def get(cluster: KubeCluster, *args: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", "-o", "json", *args).stdout)


def job_condition(cluster: KubeCluster, namespace: str, name: str) -> str | None:
    conditions = get(cluster, "job", name, "-n", namespace).get("status", {}).get("conditions", [])
    return next(
        (c["type"] for c in conditions if c["status"] == "True" and c["type"] in ("Complete", "Failed")), None
    )


def running_pod(cluster: KubeCluster, namespace: str, job_name: str) -> dict[str, Any]:
    def pod() -> dict[str, Any] | None:
        pods = get(cluster, "pods", "-n", namespace, "-l", f"job-name={job_name}")["items"]
        return next((p for p in pods if p.get("status", {}).get("phase") == "Running"), None)

    return wait_for(pod, f"a Running pod of Job {job_name}")


def test_fake_nodes_advertise_cpu_memory_and_gpus(kube_cluster: KubeCluster) -> None:
    nodes = {n["metadata"]["name"]: n for n in get(kube_cluster, "nodes", "-l", "type=kwok")["items"]}
    assert set(nodes) == set(NODES)
    for name, node in nodes.items():
        assert node["status"]["allocatable"] == NODES[name]
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True"


@pytest.mark.parametrize(("exit_code", "outcome"), [(0, "Complete"), (3, "Failed")])
def test_job_pods_run_on_a_fake_node_until_told_to_exit(
    kube_cluster: KubeCluster, exit_code: int, outcome: str
) -> None:
    ns = kube_cluster.namespace("harness-job")
    kube_cluster.kubectl("apply", "-n", ns, "-f", "-", input=job("work"))
    pod = running_pod(kube_cluster, ns, "work")
    assert pod["spec"]["nodeName"] in NODES  # the scheduler placed it (it asks for 2 GPUs)
    assert pod["status"]["podIP"].startswith("127.1.")
    assert job_condition(kube_cluster, ns, "work") is None  # runs until told otherwise

    kube_cluster.finish_pod(ns, pod["metadata"]["name"], exit_code)
    wait_for(lambda: job_condition(kube_cluster, ns, "work") == outcome, f"Job {outcome}")
    (container,) = get(kube_cluster, "pod", pod["metadata"]["name"], "-n", ns)["status"]["containerStatuses"]
    assert container["state"]["terminated"]["exitCode"] == exit_code


def test_deleting_a_job_collects_its_pods(kube_cluster: KubeCluster) -> None:
    ns = kube_cluster.namespace("harness-gc")
    kube_cluster.kubectl("apply", "-n", ns, "-f", "-", input=job("work"))
    running_pod(kube_cluster, ns, "work")
    kube_cluster.kubectl("delete", "job", "work", "-n", ns, "--cascade=background", "--wait=false")
    wait_for(lambda: not get(kube_cluster, "pods", "-n", ns)["items"], "the Job's pods gone")


def test_claims_of_the_default_class_bind(kube_cluster: KubeCluster) -> None:
    ns = kube_cluster.namespace("harness-pvc")
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "5Gi"}}},
    }
    kube_cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(claim))
    wait_for(
        lambda: get(kube_cluster, "pvc", "data", "-n", ns)["status"].get("phase") == "Bound", "claim Bound"
    )


def test_service_account_tokens_are_authorized_by_rbac(kube_cluster: KubeCluster) -> None:
    ns = kube_cluster.namespace("harness-rbac")
    kube_cluster.kubectl("create", "serviceaccount", "reader", "-n", ns)
    config = kube_cluster.service_account_kubeconfig(ns, "reader")
    denied = kube_cluster.kubectl("get", "configmaps", "-n", ns, kubeconfig=config, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr

    kube_cluster.kubectl("create", "role", "read", "--verb=list", "--resource=configmaps", "-n", ns)
    kube_cluster.kubectl(
        "create", "rolebinding", "read", "--role=read", f"--serviceaccount={ns}:reader", "-n", ns
    )
    wait_for(
        lambda: (
            kube_cluster.kubectl("get", "configmaps", "-n", ns, kubeconfig=config, check=False).returncode
            == 0
        ),
        "the RoleBinding in effect",
    )
    user = f"system:serviceaccount:{ns}:reader"

    def seen() -> set[tuple[str, str, int]]:
        return {
            (e["verb"], e["objectRef"]["resource"], e["responseStatus"]["code"])
            for e in kube_cluster.audit_events(user)
        }

    wait_for(
        lambda: {("list", "configmaps", 403), ("list", "configmaps", 200)} <= seen(), "both in the audit log"
    )
