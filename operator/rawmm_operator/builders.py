"""Every child an RLRun should have now, built by the builder modules in `rawmm_operator.children`."""

from __future__ import annotations

from typing import Literal

from rawmm_operator.children.config import build_config_map
from rawmm_operator.children.engines import (
    build_engine_headless_service,
    build_engine_service,
    build_engine_statefulset,
    engine_replicas,
)
from rawmm_operator.children.jobs import (
    build_gc_job,
    build_orchestrator_job,
    build_trainer_job,
    build_trainer_service,
)
from rawmm_operator.children.monitoring import DEFAULT_POD_MONITOR, PodMonitorSettings, build_pod_monitor
from rawmm_operator.children.offload import build_offload_claim
from rawmm_operator.objects import Manifest, RunRef
from rawmm_operator.spec import RLRunSpec, run_config

Stage = Literal["active", "finished", "expired"]


def build_children(
    run: RunRef,
    spec: RLRunSpec,
    *,
    stage: Stage = "active",
    pod_monitor: PodMonitorSettings = DEFAULT_POD_MONITOR,
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
    config = run_config(run.name, run.namespace, spec)
    children += [
        build_config_map(run, config),
        build_engine_headless_service(run),
        build_engine_service(run),
        build_engine_statefulset(
            run, spec, config, replicas=engine_replicas(spec, finished=stage == "finished")
        ),
    ]
    if stage == "active":
        if spec.trainer.nodes > 1:
            children.append(build_trainer_service(run))
        children += [build_orchestrator_job(run, spec, config), build_trainer_job(run, spec, config)]
        if spec.offload.retention.enabled:
            children.append(build_gc_job(run, spec, config))
    if pod_monitor.enabled and spec.monitoring.pod_monitor:
        children.append(build_pod_monitor(run, pod_monitor))
    return children
