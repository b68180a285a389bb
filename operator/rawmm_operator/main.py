"""Running the operator: API clients, kopf settings, liveness endpoint and the metrics server."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Collection
from typing import Any

import kopf
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from rawmm_operator.children.monitoring import DEFAULT_POD_MONITOR, PodMonitorSettings
from rawmm_operator.handlers import DEFAULT_TIMING, LoopTiming, build_registry, operator_settings
from rawmm_operator.kube import KubeApi
from rawmm_operator.reconcile import Reconciler


def cluster_api_client() -> k8s.ApiClient:
    """In-cluster service account if there is one, else the current kubeconfig context."""
    try:
        k8s_config.load_incluster_config()
    except k8s_config.ConfigException:
        k8s_config.load_kube_config()
    return k8s.ApiClient()


async def run_operator(
    api_client: k8s.ApiClient,
    *,
    login: Callable[..., Any] = kopf.login_via_client,
    namespaces: Collection[str] = (),
    liveness_endpoint: str | None = None,
    timing: LoopTiming = DEFAULT_TIMING,
    pod_monitor: PodMonitorSettings = DEFAULT_POD_MONITOR,
    settings: kopf.OperatorSettings | None = None,
    stop_flag: asyncio.Event | threading.Event | None = None,
    ready_flag: asyncio.Event | threading.Event | None = None,
) -> None:
    """Run until `stop_flag` is set (or a signal): cluster-wide unless `namespaces` are given."""
    reconciler = Reconciler(
        KubeApi(api_client), pod_monitor=pod_monitor, progress_interval=timing.progress_seconds
    )
    registry = build_registry(reconciler, login=login, timing=timing)
    await kopf.operator(
        registry=registry,
        settings=settings or operator_settings(),
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        liveness_endpoint=liveness_endpoint,
        standalone=True,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )
