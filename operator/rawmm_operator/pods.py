"""Pod, container, Job and Service primitives the children's builders are made of (pure).

A pod gets the operator's security context, the shared volume, a writable /tmp and shared memory, then
the role's overrides (`PodSettings`: env, volumes, scheduling) merged in. A Job carries the two
annotations the reconciler decides its updates by: what it runs (`TEMPLATE_HASH`) and the RLRun's
`suspend` it last carried (`RUN_SUSPEND`); `template_changed` and `job_suspend` read them back here.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from typing import Any

from rawmm.config import RunConfig
from rawmm.config.quantity import parse_byte_size
from rawmm_operator.names import child_name
from rawmm_operator.objects import (
    QUEUE_LABEL,
    RUN_LABEL,
    Manifest,
    RunRef,
    claim_name,
    labels,
    metadata,
    selector,
)
from rawmm_operator.spec import API_GROUP, RUN_CONFIG_DIR, SHARED_MOUNT, PodSettings, Resources, RLRunSpec

# The hash of what a Job runs (its spec and the run config it reads): a Job's template is immutable, so a
# changed hash means the operator replaces the Job (the new one resumes from the latest checkpoint).
TEMPLATE_HASH = f"{API_GROUP}/template-hash"
# The RLRun's `suspend` the operator last carried to a Job: the Job's own `suspend` changes only when
# the RLRun's does, so a queue (Kueue) that suspends or admits a Job is never overruled.
RUN_SUSPEND = f"{API_GROUP}/run-suspend"
# The images run as this user (images/ Dockerfiles); fsGroup makes the shared volume writable for it.
POD_USER = 1000
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"

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


def env(ours: list[dict[str, Any]], role: PodSettings) -> list[dict[str, Any]]:
    """The operator's variables, then the user's; a user variable replaces one of ours by name."""
    theirs = {e.get("name") for e in role.env}
    return [e for e in ours if e["name"] not in theirs] + list(role.env)


def volumes(run: RunRef, spec: RLRunSpec, role: PodSettings, *, config: bool) -> list[dict[str, Any]]:
    """The shared volume, /tmp and shared memory (and the run config when `config`), then the role's."""
    listed: list[dict[str, Any]] = [
        {"name": "shared", "persistentVolumeClaim": {"claimName": claim_name(run, spec)}},
        {"name": "tmp", "emptyDir": {}},
        # A memory emptyDir counts against the container's memory limit: bounded, so it cannot eat it all.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": role.shm_size}},
    ]
    if config:
        listed.append({"name": "config", "configMap": {"name": child_name(run.name, "config")}})
    return listed + list(role.volumes)


def mounts(role: PodSettings, *, config: bool) -> list[dict[str, Any]]:
    """Where `volumes` appear in the container, then the role's own mounts."""
    listed: list[dict[str, Any]] = [
        {"name": "shared", "mountPath": str(SHARED_MOUNT)},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if config:
        listed.append({"name": "config", "mountPath": str(RUN_CONFIG_DIR), "readOnly": True})
    return listed + list(role.volume_mounts)


def affinity(run: RunRef, spec: RLRunSpec, role: PodSettings) -> dict[str, Any]:
    """The role's affinity; with a ReadWriteOnce volume, plus a required affinity to the node of the run's
    other pods (the first pod placed picks the node: a pod that matches its own term may go anywhere)."""
    merged = copy.deepcopy(role.affinity)
    if spec.offload.access_mode == "ReadWriteOnce":
        pod_affinity = merged.setdefault("podAffinity", {})
        pod_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(
            {"labelSelector": {"matchLabels": {RUN_LABEL: run.name}}, "topologyKey": HOSTNAME_TOPOLOGY}
        )
    return merged


def pod_spec(
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
        "volumes": volumes(run, spec, role, config=config),
        **extra,
    }
    optional = {
        "nodeSelector": dict(role.node_selector),
        "tolerations": list(role.tolerations),
        "affinity": affinity(run, spec, role),
        "topologySpreadConstraints": list(role.topology_spread_constraints),
        "priorityClassName": role.priority_class_name,
        "schedulerName": role.scheduler_name,
        "runtimeClassName": role.runtime_class_name,
        "serviceAccountName": role.service_account_name,
        "imagePullSecrets": list(role.image_pull_secrets),
    }
    pod.update({key: value for key, value in optional.items() if value})
    return pod


def pod_template(run: RunRef, component: str, role: PodSettings, spec: dict[str, Any]) -> dict[str, Any]:
    """The pod template of a component: the role's labels and annotations, then the run's labels."""
    meta: dict[str, Any] = {"labels": {**role.labels, **labels(run, component)}}
    if role.annotations:
        meta["annotations"] = dict(role.annotations)
    return {"metadata": meta, "spec": spec}


def container(role: PodSettings, **fields: Any) -> dict[str, Any]:
    """A container of `fields`, locked down, with the role's `envFrom`."""
    made = {**fields, "securityContext": CONTAINER_SECURITY}
    if role.env_from:
        made["envFrom"] = list(role.env_from)
    return made


def service(run: RunRef, name: str, component: str, port: int, port_name: str, *, headless: bool) -> Manifest:
    """A Service in front of a component's pods on one named port."""
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
        "metadata": metadata(run, name, component),
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


def job(
    run: RunRef,
    spec: RLRunSpec,
    config: RunConfig,
    *,
    name: str,
    component: str,
    role: PodSettings,
    pod: dict[str, Any],
    **job_spec: Any,
) -> Manifest:
    """A Job running `pod` once: an eviction replaces its pod, a failure fails it; created suspended when
    the run is suspended or queued; annotated with its template hash and the run's `suspend`."""
    container_name = pod["containers"][0]["name"]
    body: dict[str, Any] = {
        # An eviction (drain, preemption, spot reclaim) is not the process's fault: the Job replaces the pod
        # and the new one resumes from the latest checkpoint. A process killed by SIGKILL (137: the OOM
        # killer, a crashed node agent, `kill -9`) is replaced too, `KILLED_RETRIES` times at most, as the
        # retryable signal exits of Kubeflow's ExitCode policy. Any other non-zero exit fails the Job (and
        # the run) with its reason in the status. SIGTERM (143, the operator stopping a failed run's other
        # pods) is a failure: a stopped pod is never replaced.
        "backoffLimit": KILLED_RETRIES,
        "podFailurePolicy": {
            "rules": [
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                {
                    "action": "Count",
                    "onExitCodes": {"containerName": container_name, "operator": "In", "values": [137]},
                },
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": container_name, "operator": "NotIn", "values": [0]},
                },
            ]
        },
        # The replacement starts once the old pod is gone: never two trainers writing one checkpoint.
        "podReplacementPolicy": "Failed",
        # Kueue admits a queued Job by unsuspending it, so such a Job is created suspended.
        "suspend": spec.suspend or run.queue_name is not None,
        **job_spec,
        "template": pod_template(run, component, role, {"restartPolicy": "Never", **pod}),
    }
    meta = metadata(run, name, component)
    meta["annotations"] = {RUN_SUSPEND: str(spec.suspend).lower(), TEMPLATE_HASH: template_hash(body, config)}
    if run.queue_name is not None:
        meta["labels"][QUEUE_LABEL] = run.queue_name
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": body}


def _annotation(manifest: dict[str, Any], key: str) -> str | None:
    annotations: dict[str, str] = manifest.get("metadata", {}).get("annotations") or {}
    return annotations.get(key)


def template_changed(built: Manifest, live: dict[str, Any]) -> bool:
    """Whether the live Job runs something else than the built one (then it is replaced: immutable)."""
    return _annotation(live, TEMPLATE_HASH) != _annotation(built, TEMPLATE_HASH)


def job_suspend(built: Manifest, live: dict[str, Any]) -> bool:
    """The `suspend` to apply to an existing Job: the built one when the RLRun's changed since it was last
    carried over, else whatever the Job has (a queue may have set it). A queued run's Jobs are built
    suspended, so resuming one leaves them for the queue to admit, as at creation."""
    if _annotation(live, RUN_SUSPEND) != _annotation(built, RUN_SUSPEND):
        return bool(built["spec"]["suspend"])
    return bool((live.get("spec") or {}).get("suspend"))


# How many times a Job's pod killed by SIGKILL is replaced (each resumes from the latest checkpoint).
KILLED_RETRIES = 2


def job_failed(job: dict[str, Any]) -> bool:
    """Whether the live Job failed."""
    return any(
        c.get("type") == "Failed" and c.get("status") == "True"
        for c in (job.get("status") or {}).get("conditions") or []
    )


def job_finished(job: dict[str, Any]) -> bool:
    """Whether the live Job completed or failed (its pods are gone for good)."""
    return any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
        for c in (job.get("status") or {}).get("conditions") or []
    )
