"""The operator as a real pod: the chart installed with Helm, its Deployment's pod running the image `make
images` built (images/operator/Dockerfile) on the real node, reaching the API server through the `kubernetes`
Service as its ServiceAccount, and reconciling an RLRun; then faults the real kubelet reports (an image that
cannot be pulled, a pod no node can take) in the RLRun's conditions."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from kube import node
from kube.cluster import KubeCluster, wait_for
from kube.images import built
from kube.installs import RELEASE_NAMESPACE, helm_release, ready_operator_pod

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
# Small enough for the fake nodes (3 x 8 GPUs), where its engines and Jobs are scheduled.
SPEC: dict[str, Any] = {
    "model": {"name": "Qwen/Qwen3-VL-4B-Instruct", "preset": "qwen3_vl"},
    "offload": {"size": "20Gi", "retainOnDelete": False},
    "inference": {"replicas": 1, "gpus": 1, "materializeCacheSize": "4Gi"},
    "trainer": {"gpusPerNode": 1, "steps": 10},
}


def get(cluster: KubeCluster, *args: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", "-o", "json", *args).stdout)


ON_REAL_NODE: dict[str, Any] = {
    "nodeSelector": {node.REAL_NODE_LABEL: "true"},
    "tolerations": [{"key": node.REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
}


def condition(body: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in body.get("status", {}).get("conditions", []) if c["type"] == type_), {})


def test_the_operator_runs_as_a_pod_reconciles_a_run_and_reports_real_pod_faults(
    real_node: KubeCluster,
) -> None:
    assert any(path.name == "rawmm-operator.tar" for path in built()), "no operator image: run `make images`"
    values = {"operator": ON_REAL_NODE, "runs": {"podMonitor": {"enabled": False}}}
    with helm_release(real_node, values):
        pod = ready_operator_pod(real_node)
        assert pod["spec"]["nodeName"] == node.NODE_NAME
        (status,) = pod["status"]["containerStatuses"]
        assert status["image"].startswith("ghcr.io/rawmm/rawmm-operator:") and status["restartCount"] == 0

        ns = real_node.namespace("node-operator")
        run = {
            "apiVersion": "rawmm.dev/v1alpha1",
            "kind": "RLRun",
            "metadata": {"name": "tiny"},
            "spec": SPEC,
        }
        real_node.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(run))

        def reconciled() -> dict[str, Any] | None:
            body = get(real_node, "rlrun", "tiny", "-n", ns)
            jobs = get(real_node, "jobs", "-n", ns)["items"]
            return body if body.get("status", {}).get("phase") and len(jobs) == 2 else None

        name = pod["metadata"]["name"]
        try:
            body = wait_for(reconciled, "the RLRun reconciled by the operator pod", timeout=120)
        except TimeoutError:
            pytest.fail(real_node.kubectl("logs", name, "-n", RELEASE_NAMESPACE, check=False).stdout[-4000:])
        assert body["status"]["phase"] in ("Pending", "Running"), body["status"]
        logs = real_node.kubectl("logs", name, "-n", RELEASE_NAMESPACE).stdout
        assert "tiny" in logs, logs[-4000:]
        real_node.kubectl("delete", "rlrun", "tiny", "-n", ns, "--wait=true", "--timeout=120s")

        # Faults the real kubelet and scheduler report: the engine's image cannot be pulled (rawmm.test
        # resolves nowhere: no registry is asked), the trainer asks the GPU-less real node for a GPU.
        faulty = {
            **SPEC,
            "inference": {
                **SPEC["inference"],
                **ON_REAL_NODE,
                "engine": "transformers",
                "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},  # the real node has 2 CPUs
                "gpus": 0,
                "image": "rawmm.test/absent:0",
            },
            "trainer": {**SPEC["trainer"], **ON_REAL_NODE},
        }
        run = {**run, "metadata": {"name": "faulty"}, "spec": faulty}
        real_node.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(run))

        def reported() -> dict[str, Any] | None:
            body = get(real_node, "rlrun", "faulty", "-n", ns)
            pulled = condition(body, "InferenceReady").get("reason") in ("ErrImagePull", "ImagePullBackOff")
            unschedulable = condition(body, "TrainerRunning").get("reason") == "Unschedulable"
            return body if pulled and unschedulable else None

        try:
            body = wait_for(reported, "the RLRun's conditions naming both faults", timeout=180)
        except TimeoutError:
            status = get(real_node, "rlrun", "faulty", "-n", ns).get("status", {})
            conditions = [
                (c["type"], c["status"], c["reason"], c["message"][:200]) for c in status["conditions"]
            ]
            pytest.fail(f"phase {status.get('phase')}, conditions {json.dumps(conditions, indent=1)}")
        assert body["status"]["phase"] != "Running", body["status"]
        assert "rawmm.test/absent:0" in condition(body, "InferenceReady")["message"]
        assert "nvidia.com/gpu" in condition(body, "TrainerRunning")["message"]
        real_node.kubectl("delete", "rlrun", "faulty", "-n", ns, "--wait=true", "--timeout=120s")
        real_node.kubectl("delete", "namespace", ns, "--wait=false")
