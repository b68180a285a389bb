"""Pure builders: an RLRun (name, namespace, uid, validated spec) -> the manifests of its children.

No I/O here. Every child is labelled with its run and component and owned by the RLRun (garbage
collected with it), except a PVC kept by `retainOnDelete` and a claim the user brought.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from rawmm.config import RunConfig
from rawmm.config.quantity import parse_byte_size
from rawmm.config.serve_argv import serve_argv
from rawmm_operator.names import child_name
from rawmm_operator.spec import (
    API_GROUP,
    API_VERSION,
    ENGINE_PORT,
    KIND,
    RUN_CONFIG_DIR,
    RUN_CONFIG_FILE,
    SHARED_MOUNT,
    TORCHRUN_PORT,
    PodSettings,
    Resources,
    RLRunSpec,
    default_image,
    run_config,
)

RUN_LABEL = f"{API_GROUP}/run"
COMPONENT_LABEL = "app.kubernetes.io/component"
# Kueue admits a Job that carries this label; copied from the RLRun to its Jobs.
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# The hash of what a Job runs (its spec and the run config it reads): a Job's template is immutable, so a
# changed hash means the operator replaces the Job (the new one resumes from the latest checkpoint).
TEMPLATE_HASH = f"{API_GROUP}/template-hash"
# The RLRun's `suspend` the operator last carried to a Job: the Job's own `suspend` changes only when
# the RLRun's does, so a queue (Kueue) that suspends or admits a Job is never overruled.
RUN_SUSPEND = f"{API_GROUP}/run-suspend"
# The images run as this user (images/ Dockerfiles); fsGroup makes the shared volume writable for it.
POD_USER = 1000
# The engines' and orchestrator's shared secret for `POST /v1/rawmm/weights` (issue #13): a Secret per run.
WEIGHTS_TOKEN_ENV = "RAWMM_WEIGHTS_TOKEN"
WEIGHTS_TOKEN_KEY = "token"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"

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
    queue_name: str | None = None  # the RLRun's Kueue queue label, if any


def run_ref(metadata: dict[str, Any], *, namespace: str, uid: str) -> RunRef:
    """The RunRef of the RLRun with ``metadata`` in ``namespace``: its name and its Kueue queue label."""
    queue = (metadata.get("labels") or {}).get(QUEUE_LABEL)
    return RunRef(name=metadata["name"], namespace=namespace, uid=uid, queue_name=queue)


def claim_name(run: RunRef, spec: RLRunSpec) -> str:
    """The offload volume's claim: the one the spec names, else the run's own."""
    return spec.offload.existing_claim or child_name(run.name, "offload")


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


def container_resources(
    resources: Resources, *, gpus: int, accelerator: str = "nvidia.com/gpu", extra_memory_bytes: int = 0
) -> dict[str, Any]:
    """Requests and limits from the spec, with `extra_memory_bytes` (an engine's cache budget) added.

    The memory request is the user's request (else their limit, which Kubernetes would copy into an
    absent request) plus the extra; a limit appears only where the user set one, plus the extra.
    Accelerators are requested and limited alike (extended resources cannot be overcommitted).
    """
    requests = dict(resources.requests)
    limits = dict(resources.limits)
    if extra_memory_bytes:
        base_request = parse_byte_size(requests.get("memory", limits.get("memory", 0)))
        requests["memory"] = format_mebibytes(base_request + extra_memory_bytes)
        if "memory" in limits:
            limits["memory"] = format_mebibytes(parse_byte_size(limits["memory"]) + extra_memory_bytes)
    if gpus:
        requests[accelerator] = gpus
        limits[accelerator] = gpus
    out: dict[str, Any] = {"requests": requests}
    if limits:
        out["limits"] = limits
    return out


POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": POD_USER,
    "runAsGroup": POD_USER,
    "fsGroup": POD_USER,
    # Re-own the volume only when its root is not ours yet: a recursive chown of a large shared volume at
    # every pod start takes minutes.
    "fsGroupChangePolicy": "OnRootMismatch",
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


def _weights_token_env(run: RunRef) -> dict[str, Any]:
    ref = {"name": child_name(run.name, "weights"), "key": WEIGHTS_TOKEN_KEY}
    return {"name": WEIGHTS_TOKEN_ENV, "valueFrom": {"secretKeyRef": ref}}


def _env(ours: list[dict[str, Any]], role: PodSettings) -> list[dict[str, Any]]:
    """The operator's variables, then the user's; a user variable replaces one of ours by name."""
    theirs = {e.get("name") for e in role.env}
    return [e for e in ours if e["name"] not in theirs] + list(role.env)


def _volumes(run: RunRef, spec: RLRunSpec, role: PodSettings, *, config: bool) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        {"name": "shared", "persistentVolumeClaim": {"claimName": claim_name(run, spec)}},
        {"name": "tmp", "emptyDir": {}},
        # A memory emptyDir counts against the container's memory limit: bounded, so it cannot eat it all.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": role.shm_size}},
    ]
    if config:
        volumes.append({"name": "config", "configMap": {"name": child_name(run.name, "config")}})
    return volumes + list(role.volumes)


def _mounts(role: PodSettings, *, config: bool) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [
        {"name": "shared", "mountPath": str(SHARED_MOUNT)},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if config:
        mounts.append({"name": "config", "mountPath": str(RUN_CONFIG_DIR), "readOnly": True})
    return mounts + list(role.volume_mounts)


def _affinity(run: RunRef, spec: RLRunSpec, role: PodSettings) -> dict[str, Any]:
    """The role's affinity; with a ReadWriteOnce volume, plus a required affinity to the node of the run's
    other pods (the first pod placed picks the node: a pod that matches its own term may go anywhere)."""
    affinity = copy.deepcopy(role.affinity)
    if spec.offload.access_mode == "ReadWriteOnce":
        pod_affinity = affinity.setdefault("podAffinity", {})
        pod_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(
            {"labelSelector": {"matchLabels": {RUN_LABEL: run.name}}, "topologyKey": HOSTNAME_TOPOLOGY}
        )
    return affinity


def _pod_spec(
    run: RunRef,
    spec: RLRunSpec,
    role: PodSettings,
    containers: list[dict[str, Any]],
    *,
    config: bool,
    **extra: Any,
) -> dict[str, Any]:
    """A pod spec of the operator's containers with the role's overrides merged in."""
    pod: dict[str, Any] = {
        "securityContext": POD_SECURITY,
        "containers": containers,
        "volumes": _volumes(run, spec, role, config=config),
        **extra,
    }
    optional = {
        "nodeSelector": dict(role.node_selector),
        "tolerations": list(role.tolerations),
        "affinity": _affinity(run, spec, role),
        "topologySpreadConstraints": list(role.topology_spread_constraints),
        "priorityClassName": role.priority_class_name,
        "schedulerName": role.scheduler_name,
        "runtimeClassName": role.runtime_class_name,
        "serviceAccountName": role.service_account_name,
        "imagePullSecrets": list(role.image_pull_secrets),
    }
    pod.update({key: value for key, value in optional.items() if value})
    return pod


def _pod_template(run: RunRef, component: str, role: PodSettings, pod_spec: dict[str, Any]) -> dict[str, Any]:
    metadata: dict[str, Any] = {"labels": {**role.labels, **labels(run, component)}}
    if role.annotations:
        metadata["annotations"] = dict(role.annotations)
    return {"metadata": metadata, "spec": pod_spec}


def _container(role: PodSettings, **fields: Any) -> dict[str, Any]:
    container = {**fields, "securityContext": CONTAINER_SECURITY}
    if role.env_from:
        container["envFrom"] = list(role.env_from)
    return container


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


def build_config_map(run: RunRef, config: RunConfig) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(run, child_name(run.name, "config"), "config"),
        "data": {RUN_CONFIG_FILE: config.to_yaml()},
    }


def build_weights_secret(run: RunRef, token: str) -> Manifest:
    """The run's weights-endpoint token: created once with a random `token`, never rewritten."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(run, child_name(run.name, "weights"), "weights"),
        "type": "Opaque",
        "stringData": {WEIGHTS_TOKEN_KEY: token},
    }


def _health_probe(*, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


STARTUP_PROBE_PERIOD = 10


def build_engine_statefulset(run: RunRef, spec: RLRunSpec, config: RunConfig, *, replicas: int) -> Manifest:
    inference = spec.inference
    container = _container(
        inference,
        name="engine",
        image=inference.image or default_image("inference"),
        command=["rawmm"],
        # As `rawmm run` starts its local replicas: the model, the shared volume's offload store and
        # checkpoints (the only place weight updates load from, with the run's token), vLLM's arguments.
        args=serve_argv(config, host="0.0.0.0", port=ENGINE_PORT),
        env=_env([_weights_token_env(run), *COMMON_ENV], inference),
        ports=[{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        resources=container_resources(
            inference.resources,
            gpus=inference.gpus,
            accelerator=inference.accelerator_resource,
            extra_memory_bytes=inference.cache_size_bytes,
        ),
        # Loading weights can take many minutes (large models on NFS): the startup probe holds the others
        # off for `startupTimeoutSeconds`.
        startupProbe=_health_probe(
            period=STARTUP_PROBE_PERIOD,
            failures=math.ceil(inference.startup_timeout_seconds / STARTUP_PROBE_PERIOD),
        ),
        readinessProbe=_health_probe(period=5, failures=3),
        livenessProbe=_health_probe(period=15, failures=4),
        volumeMounts=_mounts(inference, config=False),
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(run, child_name(run.name, "engine"), "engine"),
        "spec": {
            "serviceName": child_name(run.name, "engine_headless"),
            "replicas": replicas,
            # Replicas are independent: start and replace them all at once.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector(run, "engine")},
            "template": _pod_template(
                run, "engine", inference, _pod_spec(run, spec, inference, [container], config=False)
            ),
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


def template_hash(job_spec: dict[str, Any], config: RunConfig) -> str:
    """What a Job runs: its spec without `suspend` (which may change in place) and the run config it reads.
    Of the inference section the orchestrator reads only the engines' URLs and the trainer nothing, so
    an engine-only change (cache size, resources) restarts no Job."""
    read = config.model_dump(mode="json")
    read["inference"] = {"urls": read["inference"]["urls"]}
    what = {"spec": {k: v for k, v in job_spec.items() if k != "suspend"}, "config": read}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _job(
    run: RunRef,
    spec: RLRunSpec,
    *,
    name: str,
    component: str,
    role: PodSettings,
    pod_spec: dict[str, Any],
    **job_spec: Any,
) -> Manifest:
    container = pod_spec["containers"][0]["name"]
    body: dict[str, Any] = {
        # An eviction (drain, preemption, spot reclaim) is not the process's fault: the Job replaces the pod
        # and the new one resumes from the latest checkpoint. A non-zero exit fails the Job (and the run)
        # with its reason in the status; nothing retries silently.
        "backoffLimit": 0,
        "podFailurePolicy": {
            "rules": [
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": container, "operator": "NotIn", "values": [0]},
                },
            ]
        },
        # The replacement starts once the old pod is gone: never two trainers writing one checkpoint.
        "podReplacementPolicy": "Failed",
        # Kueue admits a queued Job by unsuspending it, so such a Job is created suspended.
        "suspend": spec.suspend or run.queue_name is not None,
        **job_spec,
        "template": _pod_template(run, component, role, {"restartPolicy": "Never", **pod_spec}),
    }
    metadata = _metadata(run, name, component)
    metadata["annotations"] = {RUN_SUSPEND: str(spec.suspend).lower()}
    if run.queue_name is not None:
        metadata["labels"][QUEUE_LABEL] = run.queue_name
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": body}


def build_orchestrator_job(run: RunRef, spec: RLRunSpec) -> Manifest:
    orchestrator = spec.orchestrator
    container = _container(
        orchestrator,
        name="orchestrator",
        image=orchestrator.image or default_image("trainer"),
        command=["rawmm"],
        args=[
            "orchestrate",
            str(RUN_CONFIG_DIR / RUN_CONFIG_FILE),
        ],
        env=_env([_weights_token_env(run), *COMMON_ENV], orchestrator),
        ports=[
            {"name": "metrics", "containerPort": spec.monitoring.orchestrator_metrics_port, "protocol": "TCP"}
        ],
        resources=container_resources(orchestrator.resources, gpus=0),
        volumeMounts=_mounts(orchestrator, config=True),
    )
    pod_spec = _pod_spec(run, spec, orchestrator, [container], config=True)
    return _job(
        run,
        spec,
        name=child_name(run.name, "orchestrator"),
        component="orchestrator",
        role=orchestrator,
        pod_spec=pod_spec,
    )


def trainer_command(run: RunRef, spec: RLRunSpec) -> list[str]:
    """`rawmm train`, under torchrun when the trainer spans several processes."""
    trainer = spec.trainer
    train = [
        "rawmm",
        "train",
        str(RUN_CONFIG_DIR / RUN_CONFIG_FILE),
    ]
    if not trainer.distributed:
        return train
    launcher = ["torchrun", f"--nproc-per-node={max(trainer.gpus_per_node, 1)}"]
    if trainer.nodes == 1:
        launcher.append("--standalone")
    else:
        # Static rendezvous on index 0 of the indexed Job, addressed through the trainer's headless Service.
        job = child_name(run.name, "trainer")
        master = f"{job}-0.{job}.{run.namespace}.svc"
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
    env: list[dict[str, Any]] = list(COMMON_ENV)
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
    container = _container(
        trainer,
        name="trainer",
        image=trainer.image or default_image("trainer"),
        command=command[:1],
        args=command[1:],
        env=_env(env, trainer),
        ports=ports,
        resources=container_resources(
            trainer.resources, gpus=trainer.gpus_per_node, accelerator=trainer.accelerator_resource
        ),
        volumeMounts=_mounts(trainer, config=True),
    )
    extra = {"subdomain": child_name(run.name, "trainer")} if trainer.nodes > 1 else {}
    pod_spec = _pod_spec(run, spec, trainer, [container], config=True, **extra)
    return _job(
        run,
        spec,
        name=child_name(run.name, "trainer"),
        component="trainer",
        role=trainer,
        pod_spec=pod_spec,
        completionMode="Indexed",
        completions=trainer.nodes,
        parallelism=trainer.nodes,
    )


def build_pod_monitor(run: RunRef, settings: PodMonitorSettings) -> Manifest:
    """Scrapes every pod of the run: engines on their HTTP port, orchestrator and trainer on `metrics`."""
    metadata = _metadata(run, child_name(run.name, "pod_monitor"), "monitoring")
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


Stage = Literal["active", "finished", "expired"]


def build_children(
    run: RunRef,
    spec: RLRunSpec,
    *,
    stage: Stage = "active",
    pod_monitor: PodMonitorSettings = PodMonitorSettings(),
) -> list[Manifest]:
    """Every child the run should have now, in creation order (volume and config before the pods that
    mount them). The weights Secret is not among them: it is created once (`build_weights_secret`).

    A finished run (Succeeded or Failed) keeps its engines at 0 replicas, releasing their accelerators,
    and no longer manages its Jobs (they stay for their logs). An expired one (`ttlSecondsAfterFinished`
    passed) keeps only its volume.
    """
    children: list[Manifest] = []
    if spec.offload.existing_claim is None:
        children.append(build_offload_claim(run, spec))
    if stage == "expired":
        return children
    replicas = 0 if stage == "finished" or spec.suspend else spec.inference.replicas
    config = run_config(run.name, run.namespace, spec)
    children += [
        build_config_map(run, config),
        _service(run, child_name(run.name, "engine_headless"), "engine", ENGINE_PORT, "http", headless=True),
        _service(run, child_name(run.name, "engine"), "engine", ENGINE_PORT, "http", headless=False),
        build_engine_statefulset(run, spec, config, replicas=replicas),
    ]
    if stage == "active":
        jobs = [build_orchestrator_job(run, spec)]
        if spec.trainer.nodes > 1:
            children.append(
                _service(
                    run,
                    child_name(run.name, "trainer"),
                    "trainer",
                    TORCHRUN_PORT,
                    "rendezvous",
                    headless=True,
                )
            )
        jobs.append(build_trainer_job(run, spec))
        if spec.offload.retention.enabled:
            from rawmm_operator.gc import build_gc_job  # gc builds on this module's helpers

            jobs.append(build_gc_job(run, spec))
        for job in jobs:
            job["metadata"]["annotations"][TEMPLATE_HASH] = template_hash(job["spec"], config)
        children += jobs
    if pod_monitor.enabled and spec.monitoring.pod_monitor:
        children.append(build_pod_monitor(run, pod_monitor))
    return children
