"""RLRun specs shared by the operator tests (the issue's example and the shapes a cluster runs), and
helpers to create runs and wait on the emulator's state."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from typing import Any

from kube.emulator import Cluster

RLRUNS = "rawmm.dev/v1alpha1/rlruns"
RLRUNS_URL = "/apis/rawmm.dev/v1alpha1/namespaces/ml/rlruns"

ISSUE_EXAMPLE: dict[str, Any] = {
    "model": {
        "name": "Qwen/Qwen3-VL-4B-Instruct",
        "preset": "qwen3_vl",
        "processorBackend": "torchvision",
        "trustRemoteCode": False,
    },
    "offload": {
        "size": "200Gi",
        "storageClassName": "nfs-client",
        "accessMode": "ReadWriteMany",
        "existingClaim": None,
        "retainOnDelete": True,
    },
    "inference": {
        "image": "registry.example/rawmm-inference:dev",
        "replicas": 2,
        "gpus": 1,
        "tensorParallelSize": 1,
        "materializeCacheSize": "4Gi",
        "resources": {"requests": {"cpu": "8", "memory": "32Gi"}},
        "extraArgs": [],
        "nodeSelector": {},
        "tolerations": [],
        "affinity": {},
    },
    "orchestrator": {
        "image": "registry.example/rawmm-trainer:dev",
        "environment": {"name": "shapes-multiturn", "args": {}},
        "promptsPerStep": 8,
        "rolloutsPerPrompt": 8,
        "maxTurns": 4,
        "maxTokens": 256,
        "maxAsyncLevel": 1,
        "resources": {"requests": {"cpu": "2", "memory": "4Gi"}},
    },
    "trainer": {
        "image": "registry.example/rawmm-trainer:dev",
        "nodes": 1,
        "gpusPerNode": 8,
        "steps": 100,
        "learningRate": 1e-6,
        "seqLen": 8192,
        # The issue's example leaves this at its default (4096), which a trainer cannot run with
        # (a truncated sample must fit one micro-batch); the CRD refuses that at creation.
        "microBatchTokens": 16384,
        "missingImagePolicy": "error",
        "resources": {"requests": {"cpu": "32", "memory": "256Gi"}},
    },
    "suspend": False,
}

CPU_ONLY: dict[str, Any] = {
    "model": {"name": "/shared/models/tiny-qwen2-vl", "preset": "qwen2_vl"},
    "offload": {"size": "5Gi", "accessMode": "ReadWriteOnce", "retainOnDelete": False},
    "inference": {
        "engine": "transformers",
        "gpus": 0,
        "materializeCacheSize": "256Mi",
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "3Gi"}},
    },
    "orchestrator": {"resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}},
    "trainer": {"gpusPerNode": 0, "steps": 2, "resources": {"requests": {"cpu": "2", "memory": "4Gi"}}},
    "monitoring": {"podMonitor": False},
}

MULTI_GPU: dict[str, Any] = {
    "model": {
        "name": "Qwen/Qwen2.5-VL-72B-Instruct",
        "preset": "qwen2_5_vl",
        "processorBackend": "torchvision",
    },
    "inference": {
        "replicas": 3,
        "gpus": 4,
        "tensorParallelSize": 4,
        "materializeCacheSize": "16Gi",
        "extraArgs": ["--max-model-len", "32768"],
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "engine"}},
                        },
                    }
                ]
            }
        },
    },
    "trainer": {"gpusPerNode": 8, "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
}

EXISTING_CLAIM: dict[str, Any] = {
    "model": {"name": "moonshotai/Kimi-K2.5", "preset": "kimi_k25", "trustRemoteCode": True},
    "offload": {"existingClaim": "team-shared-rwx"},
    "trainer": {"missingImagePolicy": "zero_loss"},
}

MULTI_NODE: dict[str, Any] = {
    "model": {"name": "Qwen/Qwen3-VL-8B-Instruct", "preset": "qwen3_vl"},
    "inference": {"replicas": 4, "gpus": 2, "tensorParallelSize": 2},
    "trainer": {"nodes": 4, "gpusPerNode": 8, "steps": 500},
}

SPECS: dict[str, dict[str, Any]] = {
    "issue-example": ISSUE_EXAMPLE,
    "cpu-only": CPU_ONLY,
    "multi-gpu": MULTI_GPU,
    "existing-claim": EXISTING_CLAIM,
    "multi-node": MULTI_NODE,
}


def rlrun(name: str, spec: dict[str, Any], namespace: str = "ml") -> dict[str, Any]:
    return {
        "apiVersion": "rawmm.dev/v1alpha1",
        "kind": "RLRun",
        "metadata": {"name": name, "namespace": namespace},
        "spec": copy.deepcopy(spec),
    }


def apply_schema_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the API server's defaulting does with a structural schema (absent fields get `default`,
    recursively, also inside a default just applied)."""
    if isinstance(value, dict) and schema.get("type") == "object":
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                apply_schema_defaults(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for item in value.values():
                apply_schema_defaults(extra, item)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            apply_schema_defaults(schema["items"], item)
    return value


def merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """`base` with `patch` merged in recursively (dicts merge, anything else replaces)."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


async def eventually(check: Callable[[], Any], *, timeout: float = 15.0, what: str = "") -> Any:
    """Wait until `check()` returns something truthy (polling the in-memory emulator)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        await asyncio.sleep(0.02)


def run_status(cluster: Cluster, name: str = "exp") -> dict[str, Any]:
    return (cluster.object(RLRUNS, "ml", name) or {}).get("status") or {}
