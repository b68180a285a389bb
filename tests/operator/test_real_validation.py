"""The RLRun CRD as kube-apiserver enforces it (tests/kube): defaults, pruning, the schema and the CEL rules
on the object as the server stores it. Every example and every spec sample the tests use is accepted;
bad specs are refused with the message a user reads from `kubectl apply`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kube.cluster import REPO, KubeCluster
from kube.installs import apply_crd
from operator_samples import SPECS, merged, rlrun

pytestmark = pytest.mark.cluster
EXAMPLES = REPO / "manifests" / "examples"


def example_runs() -> list[tuple[str, dict[str, Any]]]:
    runs = [(f"sample:{name}", rlrun(name, spec)) for name, spec in SPECS.items()]
    for path in sorted(EXAMPLES.glob("*.yaml")):
        runs += [
            (path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc and doc["kind"] == "RLRun"
        ]
    return runs


@pytest.fixture(scope="module")
def namespace(kube_cluster: KubeCluster) -> Iterator[str]:
    apply_crd(kube_cluster)
    namespace = kube_cluster.namespace("crd")
    yield namespace
    # No operator saw these runs (no finalizers): they go with the namespace, before another module's
    # cluster-wide operator would start reconciling them.
    kube_cluster.kubectl("delete", "namespace", namespace, "--wait=false")


def apply(cluster: KubeCluster, namespace: str, body: dict[str, Any]) -> tuple[int, str]:
    body = {**body, "metadata": {**body["metadata"], "namespace": namespace}}
    result = cluster.kubectl("apply", "--validate=strict", "-f", "-", input=json.dumps(body), check=False)
    return result.returncode, result.stderr


def stored(cluster: KubeCluster, namespace: str, name: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", "rlrun", name, "-n", namespace, "-o", "json").stdout)


@pytest.mark.parametrize(("source", "body"), example_runs(), ids=[s for s, _ in example_runs()])
def test_every_example_and_sample_is_accepted(
    kube_cluster: KubeCluster, namespace: str, source: str, body: dict[str, Any]
) -> None:
    code, stderr = apply(kube_cluster, namespace, body)
    assert code == 0, stderr
    spec = stored(kube_cluster, namespace, body["metadata"]["name"])["spec"]
    # Stored with the schema's defaults and nothing pruned that was sent.
    assert spec["inference"]["engine"] == body["spec"].get("inference", {}).get("engine", "vllm")
    assert spec["model"]["name"] == body["spec"]["model"]["name"]


def test_the_server_fills_defaults_and_drops_nulls(kube_cluster: KubeCluster, namespace: str) -> None:
    body = rlrun(
        "minimal", {"model": {"name": "m", "preset": "qwen2_vl"}, "offload": {"existingClaim": None}}
    )
    code, stderr = apply(kube_cluster, namespace, body)
    assert code == 0, stderr
    spec = stored(kube_cluster, namespace, "minimal")["spec"]
    assert spec["offload"]["accessMode"] == "ReadWriteMany" and "existingClaim" not in spec["offload"]
    assert spec["inference"]["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"}}
    assert "extraArgs" not in spec["inference"]


BASE = SPECS["issue-example"]
# (patch of the example, what `kubectl apply` must print)
REFUSED_AT_CREATION = {
    "vllm-without-gpus": ({"inference": {"gpus": 0, "image": ""}}, "the vllm engine needs gpus >= 1"),
    "tp-on-transformers": (
        {"inference": {"engine": "transformers", "gpus": 2, "tensorParallelSize": 2}},
        "they need engine: vllm",
    ),
    "extra-args-on-transformers": (
        {"inference": {"engine": "transformers", "extraArgs": ["--max-model-len", "4096"]}},
        "they need engine: vllm",
    ),
    "tp-above-gpus": (
        {"inference": {"gpus": 1, "tensorParallelSize": 2}},
        "cannot exceed the GPUs of one replica",
    ),
    "seq-len-above-micro-batch": ({"trainer": {"seqLen": 32768}}, "seqLen must not exceed microBatchTokens"),
    "sparse-checkpoints-without-broadcast": (
        {"trainer": {"checkpointEvery": 5}},
        "checkpointEvery above 1 needs weightTransfer broadcast",
    ),
    "rwo-multi-node": (
        {"offload": {"accessMode": "ReadWriteOnce"}, "trainer": {"nodes": 2}},
        "it needs trainer.nodes 1",
    ),
    "zero-replicas": (
        {"inference": {"replicas": 0}},
        "spec.inference.replicas in body should be greater than or equal to 1",
    ),
    "bad-quantity": (
        {"inference": {"materializeCacheSize": "2GB"}},
        "spec.inference.materializeCacheSize in body should match",
    ),
    "top-p-zero": ({"orchestrator": {"sampling": {"topP": 0}}}, "spec.orchestrator.sampling.topP"),
    "temperature-vllm-would-raise": (
        {"orchestrator": {"sampling": {"temperature": 0.001}}},
        "sampling.temperature must be 0 (greedy) or at least 0.01",
    ),
    "nucleus-sampling": ({"orchestrator": {"sampling": {"topP": 0.5}}}, "sampling.topP must be 1.0"),
    "unprefixed-accelerator": (
        {"inference": {"acceleratorResource": "gpu"}},
        "spec.inference.acceleratorResource in body should match",
    ),
    "empty-volume": ({"offload": {"size": "0"}}, "offload.size must be more than 0"),
    "metrics-port-is-torchrun": (
        {"monitoring": {"trainerMetricsPort": 29500}},
        "monitoring.trainerMetricsPort 29500 is torchrun's rendezvous port",
    ),
    "unknown-preset": ({"model": {"preset": "llava"}}, 'spec.model.preset: Unsupported value: "llava"'),
    "unknown-environment": (
        {"orchestrator": {"environment": {"name": "shapes_multiturn"}}},
        "orchestrator.environment.name must be one of colours, shapes, shapes-multiturn or 'package.module:Class'",
    ),
    "environment-module-without-its-class": (
        {"orchestrator": {"environment": {"name": "my_envs.tasks"}}},
        "orchestrator.environment.name must be one of",
    ),
    "unknown-field": ({"trainer": {"stepz": 10}}, 'unknown field "spec.trainer.stepz"'),
}


@pytest.mark.parametrize("case", sorted(REFUSED_AT_CREATION))
def test_bad_specs_are_refused_with_their_message(
    kube_cluster: KubeCluster, namespace: str, case: str
) -> None:
    patch, message = REFUSED_AT_CREATION[case]
    code, stderr = apply(kube_cluster, namespace, rlrun(case, merged(BASE, patch)))
    assert code != 0 and message in stderr, stderr
    missing = kube_cluster.kubectl("get", "rlrun", case, "-n", namespace, check=False)
    assert missing.returncode != 0  # nothing stored


# (patch applied to a stored run, what `kubectl apply` must print)
REFUSED_ON_UPDATE = {
    "model-changed": ({"model": {"name": "Qwen/Qwen3-VL-8B-Instruct"}}, "model is immutable"),
    "claim-changed": ({"offload": {"existingClaim": "other"}}, "existingClaim is immutable"),
    "class-changed": ({"offload": {"storageClassName": "fast"}}, "storageClassName is immutable"),
    "size-shrunk": ({"offload": {"size": "100Gi"}}, "offload.size cannot shrink"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_ON_UPDATE))
def test_immutable_fields_are_refused_on_update(kube_cluster: KubeCluster, namespace: str, case: str) -> None:
    patch, message = REFUSED_ON_UPDATE[case]
    original = rlrun(case, BASE)
    code, stderr = apply(kube_cluster, namespace, original)
    assert code == 0, stderr
    code, stderr = apply(kube_cluster, namespace, rlrun(case, merged(BASE, patch)))
    assert code != 0 and message in stderr, stderr
    assert stored(kube_cluster, namespace, case)["spec"]["model"] == original["spec"]["model"]


def test_allowed_updates_are_accepted(kube_cluster: KubeCluster, namespace: str) -> None:
    """Growing the volume and changing what may change (steps, replicas, suspend) pass every rule."""
    code, stderr = apply(kube_cluster, namespace, rlrun("grows", BASE))
    assert code == 0, stderr
    changed = merged(BASE, {"offload": {"size": "300Gi"}, "suspend": True})
    code, stderr = apply(kube_cluster, namespace, rlrun("grows", changed))
    assert code == 0, stderr
    spec = stored(kube_cluster, namespace, "grows")["spec"]
    assert (spec["offload"]["size"], spec["suspend"]) == ("300Gi", True)
