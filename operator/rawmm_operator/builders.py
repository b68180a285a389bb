"""Pure builders: an RLRun (name, namespace, uid, validated spec) -> the manifests of its children.

No I/O here. Every child is labelled with its run and component and owned by the RLRun (garbage
collected with it), except a PVC kept by `retainOnDelete` and a claim the user brought.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rawmm.quantity import parse_byte_size
from rawmm_operator.spec import (
    API_GROUP,
    API_VERSION,
    ENGINE_PORT,
    KIND,
    RUN_CONFIG_DIR,
    RUN_CONFIG_FILE,
    SHARED_MOUNT,
    Resources,
    RLRunSpec,
    Scheduling,
    run_config,
)

RUN_LABEL = f"{API_GROUP}/run"
COMPONENT_LABEL = "app.kubernetes.io/component"
TORCHRUN_PORT = 29500
# The images run as this user (images/ Dockerfiles); fsGroup makes the shared volume writable for it.
POD_USER = 1000
GPU_RESOURCE = "nvidia.com/gpu"

Manifest = dict[str, Any]


@dataclass(frozen=True)
class PodMonitorSettings:
    """Operator-wide PodMonitor settings (the chart's `runs.podMonitor`): `enabled=False` for clusters
    without the Prometheus Operator; `labels` so that the cluster's Prometheus selects the monitors."""

    enabled: bool = True
    interval: str = "15s"
    labels: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class RunRef:
    name: str
    namespace: str
    uid: str


# Child names, in one place so the handlers find what the builders made.
def claim_name(run: RunRef, spec: RLRunSpec) -> str:
    return spec.offload.existing_claim or f"{run.name}-offload"


def config_map_name(run: RunRef) -> str:
    return f"{run.name}-config"


def engine_name(run: RunRef) -> str:
    return f"{run.name}-engine"


def engine_headless_name(run: RunRef) -> str:
    return f"{run.name}-engine-headless"


def orchestrator_name(run: RunRef) -> str:
    return f"{run.name}-orchestrator"


def trainer_name(run: RunRef) -> str:
    return f"{run.name}-trainer"


def labels(run: RunRef, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "rawmm",
        "app.kubernetes.io/instance": run.name,
        "app.kubernetes.io/managed-by": "rawmm-operator",
        COMPONENT_LABEL: component,
        RUN_LABEL: run.name,
    }


def selector(run: RunRef, component: str) -> dict[str, str]:
    return {RUN_LABEL: run.name, COMPONENT_LABEL: component}


def owner_reference(run: RunRef) -> dict[str, Any]:
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "name": run.name,
        "uid": run.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(run: RunRef, name: str, component: str, *, owned: bool = True) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": run.namespace, "labels": labels(run, component)}
    if owned:
        meta["ownerReferences"] = [owner_reference(run)]
    return meta


def format_mebibytes(n_bytes: int) -> str:
    return f"{math.ceil(n_bytes / 2**20)}Mi"


def container_resources(resources: Resources, *, gpus: int, extra_memory_bytes: int = 0) -> dict[str, Any]:
    """Requests/limits from the spec, with `extra_memory_bytes` added to memory and GPUs as a limit."""
    requests = dict(resources.requests)
    limits = dict(resources.limits)
    if extra_memory_bytes:
        base_request = parse_byte_size(requests.get("memory", 0))
        requests["memory"] = format_mebibytes(base_request + extra_memory_bytes)
        # Without a limit of its own the container may use what it requested: the cache must fit.
        base_limit = parse_byte_size(limits["memory"]) if "memory" in limits else base_request
        limits["memory"] = format_mebibytes(base_limit + extra_memory_bytes)
    if gpus:
        requests[GPU_RESOURCE] = gpus
        limits[GPU_RESOURCE] = gpus
    out: dict[str, Any] = {"requests": requests}
    if limits:
        out["limits"] = limits
    return out


def _scheduling(section: Scheduling) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if section.node_selector:
        out["nodeSelector"] = dict(section.node_selector)
    if section.tolerations:
        out["tolerations"] = list(section.tolerations)
    if section.affinity:
        out["affinity"] = dict(section.affinity)
    return out


POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": POD_USER,
    "runAsGroup": POD_USER,
    "fsGroup": POD_USER,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
# Writable places for a read-only root filesystem: caches under HOME, the hub cache on the shared volume
# (downloaded once for every replica), and shared memory for torch's inter-process tensors.
COMMON_ENV = [
    {"name": "HOME", "value": "/tmp"},
    {"name": "HF_HOME", "value": str(SHARED_MOUNT / ".cache" / "huggingface")},
]


def _volumes(run: RunRef, spec: RLRunSpec, *, config: bool) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        {"name": "shared", "persistentVolumeClaim": {"claimName": claim_name(run, spec)}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    if config:
        volumes.append({"name": "config", "configMap": {"name": config_map_name(run)}})
    return volumes


def _mounts(*, config: bool) -> list[dict[str, Any]]:
    mounts = [
        {"name": "shared", "mountPath": str(SHARED_MOUNT)},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if config:
        mounts.append({"name": "config", "mountPath": str(RUN_CONFIG_DIR), "readOnly": True})
    return mounts


def build_offload_claim(run: RunRef, spec: RLRunSpec) -> Manifest:
    offload = spec.offload
    claim: Manifest = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(run, claim_name(run, spec), "offload", owned=not offload.retain_on_delete),
        "spec": {
            "accessModes": [offload.access_mode],
            "resources": {"requests": {"storage": offload.size}},
        },
    }
    if offload.storage_class_name is not None:
        claim["spec"]["storageClassName"] = offload.storage_class_name
    return claim


def build_config_map(run: RunRef, spec: RLRunSpec) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(run, config_map_name(run), "config"),
        "data": {RUN_CONFIG_FILE: run_config(run.name, run.namespace, spec).to_yaml()},
    }


def _health_probe(*, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def build_engine_statefulset(run: RunRef, spec: RLRunSpec, *, replicas: int) -> Manifest:
    inference = spec.inference
    args = [
        "serve",
        "--model", spec.model.name,
        "--engine", inference.engine,
        "--host", "0.0.0.0",
        "--port", str(ENGINE_PORT),
        "--offload-root", str(SHARED_MOUNT / "images"),
        "--processor-backend", spec.model.processor_backend,
    ]  # fmt: skip
    if spec.model.trust_remote_code:
        args.append("--trust-remote-code")
    # vLLM's own arguments follow `--` (`rawmm serve` hands them to vLLM's server).
    vllm_args = list(inference.extra_args)
    if inference.tensor_parallel_size > 1:
        vllm_args = ["--tensor-parallel-size", str(inference.tensor_parallel_size), *vllm_args]
    if vllm_args:
        args += ["--", *vllm_args]
    container = {
        "name": "engine",
        "image": inference.image,
        "command": ["rawmm"],
        "args": args,
        "env": [
            {"name": "RAWMM_MATERIALIZE_CACHE_SIZE", "value": inference.materialize_cache_size},
            *COMMON_ENV,
        ],
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "resources": container_resources(
            inference.resources, gpus=inference.gpus, extra_memory_bytes=inference.cache_size_bytes
        ),
        # Loading weights can take many minutes: the startup probe holds the others off until then.
        "startupProbe": _health_probe(period=10, failures=180),
        "readinessProbe": _health_probe(period=5, failures=3),
        "livenessProbe": _health_probe(period=15, failures=4),
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": _mounts(config=False),
    }
    pod_labels = labels(run, "engine")
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(run, engine_name(run), "engine"),
        "spec": {
            "serviceName": engine_headless_name(run),
            "replicas": replicas,
            # Replicas are independent: start and replace them all at once.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector(run, "engine")},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "securityContext": POD_SECURITY,
                    "containers": [container],
                    "volumes": _volumes(run, spec, config=False),
                    **_scheduling(inference),
                },
            },
        },
    }


def _service(
    run: RunRef, name: str, component: str, port: int, port_name: str, *, headless: bool
) -> Manifest:
    service_spec: dict[str, Any] = {
        "selector": selector(run, component),
        "ports": [{"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}],
    }
    if headless:
        # Per-pod DNS names exist from the pod's start; clients retry until the server answers.
        service_spec.update(clusterIP="None", publishNotReadyAddresses=True)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(run, name, component),
        "spec": service_spec,
    }


def _job(
    run: RunRef, spec: RLRunSpec, *, name: str, component: str, pod_spec: dict[str, Any], **job_spec: Any
) -> Manifest:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(run, name, component),
        "spec": {
            # A failed RL process fails the run with its reason in the status; nothing retries silently.
            "backoffLimit": 0,
            "suspend": spec.suspend,
            **job_spec,
            "template": {
                "metadata": {"labels": labels(run, component)},
                "spec": {"restartPolicy": "Never", "securityContext": POD_SECURITY, **pod_spec},
            },
        },
    }


def build_orchestrator_job(run: RunRef, spec: RLRunSpec) -> Manifest:
    orchestrator = spec.orchestrator
    container = {
        "name": "orchestrator",
        "image": orchestrator.image,
        "command": ["rawmm"],
        "args": ["orchestrate", str(RUN_CONFIG_DIR / RUN_CONFIG_FILE)],
        "env": list(COMMON_ENV),
        "ports": [
            {"name": "metrics", "containerPort": spec.monitoring.orchestrator_metrics_port, "protocol": "TCP"}
        ],
        "resources": container_resources(orchestrator.resources, gpus=0),
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": _mounts(config=True),
    }
    pod_spec = {
        "containers": [container],
        "volumes": _volumes(run, spec, config=True),
        **_scheduling(orchestrator),
    }
    return _job(run, spec, name=orchestrator_name(run), component="orchestrator", pod_spec=pod_spec)


def trainer_command(run: RunRef, spec: RLRunSpec) -> list[str]:
    """`rawmm train`, under torchrun when the trainer spans several processes."""
    train = ["rawmm", "train", str(RUN_CONFIG_DIR / RUN_CONFIG_FILE)]
    trainer = spec.trainer
    if not trainer.distributed:
        return train
    launcher = ["torchrun", f"--nproc-per-node={max(trainer.gpus_per_node, 1)}"]
    if trainer.nodes == 1:
        launcher.append("--standalone")
    else:
        # Static rendezvous on index 0 of the indexed Job, addressed through the trainer's headless Service.
        master = f"{trainer_name(run)}-0.{trainer_name(run)}.{run.namespace}.svc"
        launcher += [
            f"--nnodes={trainer.nodes}",
            "--node-rank=$(NODE_RANK)",
            f"--master-addr={master}",
            f"--master-port={TORCHRUN_PORT}",
        ]
    return [*launcher, "--no-python", *train]


def build_trainer_job(run: RunRef, spec: RLRunSpec) -> Manifest:
    trainer = spec.trainer
    command = trainer_command(run, spec)
    env = list(COMMON_ENV)
    ports = [{"name": "metrics", "containerPort": spec.monitoring.trainer_metrics_port, "protocol": "TCP"}]
    if trainer.nodes > 1:
        env.append(
            {
                "name": "NODE_RANK",
                "valueFrom": {
                    "fieldRef": {
                        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
                    }
                },
            }
        )
        ports.append({"name": "rendezvous", "containerPort": TORCHRUN_PORT, "protocol": "TCP"})
    container = {
        "name": "trainer",
        "image": trainer.image,
        "command": command[:1],
        "args": command[1:],
        "env": env,
        "ports": ports,
        "resources": container_resources(trainer.resources, gpus=trainer.gpus_per_node),
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": _mounts(config=True),
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": _volumes(run, spec, config=True),
        **_scheduling(trainer),
    }
    if trainer.nodes > 1:
        pod_spec["subdomain"] = trainer_name(run)
    return _job(
        run,
        spec,
        name=trainer_name(run),
        component="trainer",
        pod_spec=pod_spec,
        completionMode="Indexed",
        completions=trainer.nodes,
        parallelism=trainer.nodes,
    )


def build_pod_monitor(run: RunRef, settings: PodMonitorSettings) -> Manifest:
    """Scrapes every pod of the run: engines on their HTTP port, orchestrator and trainer on `metrics`."""
    metadata = _metadata(run, run.name, "monitoring")
    metadata["labels"].update(dict(settings.labels))
    endpoints = [
        {"port": port, "path": "/metrics", "interval": settings.interval} for port in ("http", "metrics")
    ]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": metadata,
        "spec": {"selector": {"matchLabels": {RUN_LABEL: run.name}}, "podMetricsEndpoints": endpoints},
    }


def build_children(
    run: RunRef,
    spec: RLRunSpec,
    *,
    finished: bool = False,
    pod_monitor: PodMonitorSettings = PodMonitorSettings(),
) -> list[Manifest]:
    """Every child of the run, in creation order (volume and config before the pods that mount them).

    A finished run (Succeeded or Failed) keeps its engines at 0 replicas, releasing their GPUs, and no
    longer manages its Jobs (they stay for their logs; a deleted one is not recreated).
    """
    replicas = 0 if finished or spec.suspend else spec.inference.replicas
    children: list[Manifest] = []
    if spec.offload.existing_claim is None:
        children.append(build_offload_claim(run, spec))
    children += [
        build_config_map(run, spec),
        _service(run, engine_headless_name(run), "engine", ENGINE_PORT, "http", headless=True),
        _service(run, engine_name(run), "engine", ENGINE_PORT, "http", headless=False),
        build_engine_statefulset(run, spec, replicas=replicas),
    ]
    if not finished:
        children.append(build_orchestrator_job(run, spec))
        if spec.trainer.nodes > 1:
            children.append(
                _service(run, trainer_name(run), "trainer", TORCHRUN_PORT, "rendezvous", headless=True)
            )
        children.append(build_trainer_job(run, spec))
    if pod_monitor.enabled and spec.monitoring.pod_monitor:
        children.append(build_pod_monitor(run, pod_monitor))
    return children
