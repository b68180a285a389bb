"""The inference engines: a StatefulSet of `rawmm serve` replicas and its two Services."""

from __future__ import annotations

import math
from typing import Any

from rawmm.config import RunConfig
from rawmm.config.serve_argv import serve_argv
from rawmm_operator import pods
from rawmm_operator.children.config import weights_token_env
from rawmm_operator.names import child_name
from rawmm_operator.objects import Manifest, RunRef, metadata, selector
from rawmm_operator.spec import ENGINE_PORT, SHARED_MOUNT, RLRunSpec, default_image

COMPONENT = "engine"
STARTUP_PROBE_PERIOD = 10


def _health_probe(*, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def engine_replicas(spec: RLRunSpec, *, finished: bool) -> int:
    """A finished or suspended run keeps its engines at 0 replicas, releasing their accelerators."""
    return 0 if finished or spec.suspend else spec.inference.replicas


def build_engine_statefulset(run: RunRef, spec: RLRunSpec, config: RunConfig, *, replicas: int) -> Manifest:
    inference = spec.inference
    container = pods.container(
        inference,
        name="engine",
        image=inference.image or default_image("inference"),
        command=["rawmm"],
        # As `rawmm run` starts its local replicas: the model, the shared volume's offload store and
        # checkpoints (the only place weight updates load from, with the run's token), vLLM's arguments.
        args=serve_argv(config, host="0.0.0.0", port=ENGINE_PORT),
        env=pods.env([weights_token_env(run), *pods.COMMON_ENV], inference),
        ports=[{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        resources=pods.container_resources(
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
        volumeMounts=pods.mounts(inference, config=False),
    )
    # `rawmm serve` refuses an offload or weights root that does not exist, and on a fresh claim nothing else
    # makes them in time: the trainer writes `checkpoints/` after its first step, which needs the engines.
    # So the pod makes the run's own directories (`spec.run_dir`) before the engine starts.
    directories = pods.container(
        inference,
        name="run-dir",
        image=container["image"],
        command=[
            "mkdir",
            "-p",
            *(str(d) for d in (config.offload_dir, config.rollouts_dir, config.checkpoints_dir)),
        ],
        resources={"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
        volumeMounts=[{"name": "shared", "mountPath": str(SHARED_MOUNT)}],
    )
    pod_spec = pods.pod_spec(run, spec, inference, [container], config=False)
    pod_spec["initContainers"] = [directories]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(run, child_name(run.name, "engine"), COMPONENT),
        "spec": {
            "serviceName": child_name(run.name, "engine_headless"),
            "replicas": replicas,
            # Replicas are independent: start and replace them all at once.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector(run, COMPONENT)},
            "template": pods.pod_template(run, COMPONENT, inference, pod_spec),
        },
    }


def build_engine_service(run: RunRef) -> Manifest:
    """The engines behind one address."""
    return pods.service(run, child_name(run.name, "engine"), COMPONENT, ENGINE_PORT, "http", headless=False)


def build_engine_headless_service(run: RunRef) -> Manifest:
    """Per-replica DNS names, for the orchestrator's sticky routing."""
    name = child_name(run.name, "engine_headless")
    return pods.service(run, name, COMPONENT, ENGINE_PORT, "http", headless=True)
