"""The run's PodMonitor: Prometheus scrapes every pod of the run (a Prometheus Operator CRD)."""

from __future__ import annotations

from dataclasses import dataclass

from rawmm_operator.names import child_name
from rawmm_operator.objects import RUN_LABEL, Manifest, RunRef, metadata

COMPONENT = "monitoring"


@dataclass(frozen=True)
class PodMonitorSettings:
    """Operator-wide PodMonitor settings (the chart's `runs.podMonitor`): `enabled=False` for clusters
    without the Prometheus Operator; `labels` so that the cluster's Prometheus selects the monitors."""

    enabled: bool = True
    interval: str = "15s"
    labels: tuple[tuple[str, str], ...] = ()


DEFAULT_POD_MONITOR = PodMonitorSettings()


def build_pod_monitor(run: RunRef, settings: PodMonitorSettings) -> Manifest:
    """Scrapes every pod of the run: engines on their HTTP port, orchestrator and trainer on `metrics`."""
    meta = metadata(run, child_name(run.name, "pod_monitor"), COMPONENT)
    meta["labels"].update(dict(settings.labels))
    endpoints = [
        {"port": port, "path": "/metrics", "interval": settings.interval} for port in ("http", "metrics")
    ]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": meta,
        "spec": {"selector": {"matchLabels": {RUN_LABEL: run.name}}, "podMetricsEndpoints": endpoints},
    }
