"""Run progress for the status: the trainer's step and the engines' cache hit rate, read from the
pods' own Prometheus endpoints (the operator needs no Prometheus for its printer columns).

The hit rate is a rate like everywhere else (docs/architecture.md §8): hits over lookups between the two
latest scrapes, never the ratio of the cumulative counters. Lookups are hits + misses + in-flight joins, as
the cache itself counts them (and the chart's alert).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from rawmm_operator.children.engines import COMPONENT as ENGINE_COMPONENT
from rawmm_operator.children.jobs import GC_COMPONENT, TRAINER_COMPONENT
from rawmm_operator.kube import KubeApi
from rawmm_operator.objects import COMPONENT_LABEL, RUN_LABEL
from rawmm_operator.status import OffloadUsage, Progress

# The names the trainer, the engines and the GC process export: the operator may not import their metric
# modules, so tests/operator/test_operator_progress.py checks these against the definitions.
TRAINER_STEP = "rawmm_trainer_step"
CACHE_HITS = "rawmm_materialize_cache_hits_total"
CACHE_MISSES = "rawmm_materialize_cache_misses_total"
CACHE_JOINS = "rawmm_materialize_cache_inflight_joins_total"
# The GC process's (offload.retention) view of the volume.
OFFLOAD_BYTES = "rawmm_offload_bytes"
OFFLOAD_FILES = "rawmm_offload_files"
GC_FREED_BYTES = "rawmm_offload_gc_freed_bytes_total"
GC_LAST_RUN = "rawmm_offload_gc_last_run_timestamp_seconds"


def metrics_url(pod: dict[str, Any], port_name: str) -> str | None:
    """The pod's /metrics URL on its named port, if it runs and has an IP."""
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or not status.get("podIP"):
        return None
    for container in pod.get("spec", {}).get("containers", []):
        for port in container.get("ports", []):
            if port.get("name") == port_name:
                return f"http://{status['podIP']}:{port['containerPort']}/metrics"
    return None


def sample_sums(text: str, names: set[str]) -> dict[str, float]:
    """Sum of every sample of each wanted metric in a Prometheus text exposition."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


@dataclass
class _Lookups:
    hits: float
    lookups: float


def offload_usage(scrapes: list[dict[str, float]]) -> OffloadUsage | None:
    """The volume's usage from the GC pod's metrics; None until it has finished a pass."""
    done = [r for r in scrapes if r.get(GC_LAST_RUN)]
    if not done:
        return None
    r = done[0]  # one GC pod per run
    when = datetime.fromtimestamp(r[GC_LAST_RUN], tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return OffloadUsage(
        bytes=int(r.get(OFFLOAD_BYTES, 0)),
        files=int(r.get(OFFLOAD_FILES, 0)),
        gc_freed_bytes=int(r.get(GC_FREED_BYTES, 0)),
        last_gc_time=when,
    )


class ProgressReader:
    """Scrapes a run's trainer and engine pods; remembers the last cache counters per run."""

    def __init__(self, api: KubeApi, *, timeout: float = 2.0, last_timeout: float = 10.0) -> None:
        self.api = api
        self.timeout = timeout
        # The read that ends a run is its one chance: its engines may be busy loading the last weights.
        self.last_timeout = last_timeout
        self._last: dict[tuple[str, str], _Lookups] = {}

    def forget(self, namespace: str, run: str) -> None:
        self._last.pop((namespace, run), None)

    def _scrape(self, client: httpx.Client, urls: list[str], names: set[str]) -> list[dict[str, float]]:
        results = []
        for url in urls:
            try:
                response = client.get(url)
                response.raise_for_status()
                results.append(sample_sums(response.text, names))
            except (httpx.HTTPError, ValueError):
                continue  # a pod that is starting or going away: the next pass tries again
        return results

    def read(self, namespace: str, run: str, previous: Progress, *, last: bool = False) -> Progress:
        """The run's progress: the trainer step, and the hit rate of the engines' lookups since the read
        before (counters that only ever grew before it are not this run's recent behaviour). `last`, the read
        as the run ends, waits longer for slow pods and, when no earlier pair of reads gave a rate (a short
        run ends between two reads), gives the rate of every lookup the engines counted."""
        pods = self.api.list("Pod", namespace, {RUN_LABEL: run})
        by_component: dict[str, list[str]] = {ENGINE_COMPONENT: [], TRAINER_COMPONENT: [], GC_COMPONENT: []}
        for pod in pods:
            component = pod.get("metadata", {}).get("labels", {}).get(COMPONENT_LABEL)
            url = metrics_url(pod, "http" if component == ENGINE_COMPONENT else "metrics")
            if component in by_component and url:
                by_component[component].append(url)
        with httpx.Client(timeout=self.last_timeout if last else self.timeout) as client:
            trainer = self._scrape(client, by_component[TRAINER_COMPONENT], {TRAINER_STEP})
            engines = self._scrape(
                client, by_component[ENGINE_COMPONENT], {CACHE_HITS, CACHE_MISSES, CACHE_JOINS}
            )
            gc = self._scrape(
                client,
                by_component[GC_COMPONENT],
                {OFFLOAD_BYTES, OFFLOAD_FILES, GC_FREED_BYTES, GC_LAST_RUN},
            )
        steps = [int(r[TRAINER_STEP]) for r in trainer if TRAINER_STEP in r]
        step = max(steps) if steps else previous.trainer_step
        rate = previous.cache_hit_rate
        if engines:
            hits = sum(r.get(CACHE_HITS, 0.0) for r in engines)
            lookups = hits + sum(r.get(CACHE_MISSES, 0.0) + r.get(CACHE_JOINS, 0.0) for r in engines)
            now = _Lookups(hits, lookups)
            before = self._last.get((namespace, run))
            self._last[(namespace, run)] = now
            if before is not None:
                delta = _Lookups(now.hits - before.hits, now.lookups - before.lookups)
                if delta.hits < 0 or delta.lookups < 0:  # an engine restarted: its counters began again
                    delta = now
                if delta.lookups > 0:
                    rate = round(delta.hits / delta.lookups, 4)
            if rate is None and last and now.lookups > 0:
                rate = round(now.hits / now.lookups, 4)
        return Progress(trainer_step=step, cache_hit_rate=rate, offload_usage=offload_usage(gc))
