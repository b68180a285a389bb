"""Starting the operator (`rawmm_operator.main`): which API credentials it takes, and how `run_operator`
wires the reconciler, the registry and kopf together (kopf itself stood in for)."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from rawmm_operator import main
from rawmm_operator.children.monitoring import DEFAULT_POD_MONITOR, PodMonitorSettings
from rawmm_operator.handlers import DEFAULT_TIMING, LoopTiming
from rawmm_operator.objects import RUN_LABEL
from rawmm_operator.reconcile import Reconciler


def test_in_a_cluster_the_service_account_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded: list[str] = []
    monkeypatch.setattr(k8s_config, "load_incluster_config", lambda: loaded.append("in-cluster"))
    monkeypatch.setattr(k8s_config, "load_kube_config", lambda: loaded.append("kubeconfig"))
    assert isinstance(main.cluster_api_client(), k8s.ApiClient)
    assert loaded == ["in-cluster"]


def test_outside_a_cluster_the_kubeconfig_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded: list[str] = []

    def not_in_a_cluster() -> None:
        raise k8s_config.ConfigException("no service account")

    monkeypatch.setattr(k8s_config, "load_incluster_config", not_in_a_cluster)
    monkeypatch.setattr(k8s_config, "load_kube_config", lambda: loaded.append("kubeconfig"))
    assert isinstance(main.cluster_api_client(), k8s.ApiClient)
    assert loaded == ["kubeconfig"]


class Started:
    """What `run_operator` handed to the registry and to kopf."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reconciler: Reconciler | None = None
        self.timing: LoopTiming | None = None
        self.registry: kopf.OperatorRegistry | None = None
        self.operator: dict[str, Any] = {}
        build_registry = main.build_registry

        def recording_registry(reconciler: Reconciler, **kwargs: Any) -> kopf.OperatorRegistry:
            self.reconciler, self.timing = reconciler, kwargs["timing"]
            self.registry = build_registry(reconciler, **kwargs)
            return self.registry

        async def operator(**kwargs: Any) -> None:
            self.operator = kwargs

        monkeypatch.setattr(main, "build_registry", recording_registry)
        monkeypatch.setattr(kopf, "operator", operator)


def run(**kwargs: Any) -> None:
    asyncio.run(main.run_operator(k8s.ApiClient(), **kwargs))


def test_without_namespaces_it_watches_the_whole_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    started = Started(monkeypatch)
    run()
    assert started.operator["clusterwide"] is True and started.operator["namespaces"] == []
    assert started.operator["standalone"] is True  # one replica; no peering objects needed
    assert started.registry is not None and started.operator["registry"] is started.registry
    assert started.reconciler is not None and started.reconciler.pod_monitor == DEFAULT_POD_MONITOR
    assert started.timing == DEFAULT_TIMING
    # the default settings: child watches filtered by the run label
    assert started.operator["settings"].watching.label_selectors["batch", "v1", "jobs"] == RUN_LABEL


def test_its_options_reach_the_reconciler_and_kopf(monkeypatch: pytest.MonkeyPatch) -> None:
    started = Started(monkeypatch)
    timing = LoopTiming(resync_seconds=7, progress_seconds=42)
    monitors = PodMonitorSettings(enabled=False)
    settings = kopf.OperatorSettings()
    run(namespaces=["team-a", "team-b"], liveness_endpoint="http://0.0.0.0:8080/healthz", timing=timing,
        pod_monitor=monitors, settings=settings)  # fmt: skip
    assert started.operator["clusterwide"] is False
    assert started.operator["namespaces"] == ["team-a", "team-b"]
    assert started.operator["liveness_endpoint"] == "http://0.0.0.0:8080/healthz"
    assert started.operator["settings"] is settings
    assert started.timing == timing
    assert started.reconciler is not None
    assert started.reconciler.pod_monitor == monitors
    assert started.reconciler.progress_interval == 42
