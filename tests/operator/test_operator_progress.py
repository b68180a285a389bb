"""Trainer step and cache hit rate read from the run's pods into the RLRun status."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from kube.emulator import Cluster, emulated_cluster, running_operator
from operator_samples import CPU_ONLY, RLRUNS_URL, eventually, rlrun, run_status
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.metrics import MetricWrapperBase

from rawmm.materialize import metrics as materialize_metrics
from rawmm.rl.retention import metrics as retention_metrics
from rawmm.rl.trainer import metrics as trainer_metrics
from rawmm_operator import progress
from rawmm_operator.handlers import LoopTiming
from rawmm_operator.progress import CACHE_HITS, ProgressReader, metrics_url, sample_sums
from rawmm_operator.status import Progress

# What the operator reads (`rawmm_operator.progress`, which may not import rawmm's metric modules) -> the
# metric that exports it: the trainer's step, the engines' cache counters, the GC process's volume usage.
READ_FROM: dict[str, MetricWrapperBase] = {
    progress.TRAINER_STEP: trainer_metrics.STEP,
    progress.CACHE_HITS: materialize_metrics.CACHE_HITS,
    progress.CACHE_MISSES: materialize_metrics.CACHE_MISSES,
    progress.CACHE_JOINS: materialize_metrics.CACHE_INFLIGHT_JOINS,
    progress.OFFLOAD_BYTES: retention_metrics.OFFLOAD_BYTES,
    progress.OFFLOAD_FILES: retention_metrics.OFFLOAD_FILES,
    progress.GC_FREED_BYTES: retention_metrics.GC_FREED_BYTES,
    progress.GC_LAST_RUN: retention_metrics.GC_LAST_RUN,
}


def test_every_metric_the_operator_reads_is_mapped_to_its_definition() -> None:
    read = {
        value for name, value in vars(progress).items() if name.isupper() and str(value).startswith("rawmm_")
    }
    assert read == set(READ_FROM)


@pytest.mark.parametrize("name", sorted(READ_FROM))
def test_the_operator_reads_each_metric_under_the_name_its_process_exports(name: str) -> None:
    """Renaming a trainer, engine or GC metric without `progress.py` would silently freeze the status."""
    exported = {sample.name for family in READ_FROM[name].collect() for sample in family.samples}
    assert name in exported


def test_sample_sums_add_up_every_label_set() -> None:
    text = (
        "# TYPE rawmm_materialize_cache_hits counter\n"
        'rawmm_materialize_cache_hits_total{replica="0"} 3.0\n'
        'rawmm_materialize_cache_hits_total{replica="1"} 4.0\n'
        "rawmm_materialize_cache_misses_total 2.0\n"
    )
    assert sample_sums(text, {CACHE_HITS}) == {CACHE_HITS: 7.0}


@pytest.mark.parametrize(
    ("status", "url"),
    [
        ({"phase": "Running", "podIP": "10.0.0.7"}, "http://10.0.0.7:9102/metrics"),
        ({"phase": "Pending", "podIP": "10.0.0.7"}, None),
        ({"phase": "Running"}, None),
    ],
)
def test_metrics_url_of_a_running_pod(status: dict[str, Any], url: str | None) -> None:
    pod = {
        "spec": {"containers": [{"ports": [{"name": "metrics", "containerPort": 9102}]}]},
        "status": status,
    }
    assert metrics_url(pod, "metrics") == url


class Exporter:
    """A real Prometheus endpoint on loopback standing in for one pod."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.server, self.thread = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self.port = self.server.server_port

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@contextlib.contextmanager
def exporters(count: int) -> Iterator[list[Exporter]]:
    started = [Exporter() for _ in range(count)]
    try:
        yield started
    finally:
        for exporter in started:
            exporter.close()


def pod(name: str, component: str, port_name: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {"rawmm.dev/run": "exp", "app.kubernetes.io/component": component},
        },
        "spec": {
            "containers": [
                {"name": component, "image": "x", "ports": [{"name": port_name, "containerPort": port}]}
            ]
        },
        "status": {"phase": "Running", "podIP": "127.0.0.1"},
    }


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with emulated_cluster() as running:
        yield running


@pytest.mark.cluster
async def test_status_shows_trainer_step_and_cache_hit_rate_between_scrapes(cluster: Cluster) -> None:
    with exporters(3) as (engine_0, engine_1, trainer):
        hits = [
            Counter("rawmm_materialize_cache_hits", "", registry=e.registry) for e in (engine_0, engine_1)
        ]
        misses = [
            Counter("rawmm_materialize_cache_misses", "", registry=e.registry) for e in (engine_0, engine_1)
        ]
        joins = Counter("rawmm_materialize_cache_inflight_joins", "", registry=engine_0.registry)
        step = Gauge("rawmm_trainer_step", "", registry=trainer.registry)
        step.set(7)
        for counter in (*hits, *misses):
            counter.inc(10)  # cumulative 50% before the operator looks: must not be reported as the rate
        for body in (
            pod("exp-engine-0", "engine", "http", engine_0.port),
            pod("exp-engine-1", "engine", "http", engine_1.port),
            pod("exp-trainer-0-abcde", "trainer", "metrics", trainer.port),
        ):
            response = await cluster.emulator.post("/api/v1/namespaces/ml/pods", json=body)
            assert response.status < 300

        timing = LoopTiming(resync_seconds=0.2, error_backoffs=(0.1,), progress_seconds=0.0)
        async with running_operator(cluster, timing=timing):
            response = await cluster.emulator.post(RLRUNS_URL, json=rlrun("exp", CPU_ONLY))
            assert response.status < 300
            await eventually(lambda: run_status(cluster).get("trainerStep") == 7, what="the trainer step")
            assert run_status(cluster).get("cacheHitRate") is None  # one scrape: no rate yet
            hits[0].inc(20)
            hits[1].inc(10)
            misses[1].inc(6)
            joins.inc(4)  # since the first scrape: 30 hits of 40 lookups
            await eventually(lambda: run_status(cluster).get("cacheHitRate") == 0.75, what="the hit rate")
            step.set(8)
            await eventually(lambda: run_status(cluster).get("trainerStep") == 8)


class PodList:
    """The one KubeApi call the progress reader makes, answered from a list the test changes."""

    def __init__(self) -> None:
        self.pods: list[dict[str, Any]] = []

    def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        return self.pods


def test_hit_rate_after_an_engine_restart_counts_from_its_new_counters() -> None:
    api = PodList()
    reader = ProgressReader(api)
    with exporters(2) as (before, after):
        Counter("rawmm_materialize_cache_hits", "", registry=before.registry).inc(90)
        Counter("rawmm_materialize_cache_misses", "", registry=before.registry).inc(10)
        api.pods = [pod("exp-engine-0", "engine", "http", before.port)]
        first = reader.read("ml", "exp", Progress())
        assert first.cache_hit_rate is None  # one scrape: no rate yet
        # The engine restarted: its counters began again, below the last scrape's (3 hits of 4 lookups).
        Counter("rawmm_materialize_cache_hits", "", registry=after.registry).inc(3)
        Counter("rawmm_materialize_cache_misses", "", registry=after.registry).inc(1)
        api.pods = [pod("exp-engine-0", "engine", "http", after.port)]
        assert reader.read("ml", "exp", Progress(cache_hit_rate=0.9)).cache_hit_rate == 0.75


def test_the_read_that_ends_a_run_without_a_rate_gives_every_lookup_the_engines_counted() -> None:
    """A short run can end between two reads: its engines' traffic then fell in no window, and its status
    would show no hit rate at all. The last read, when no earlier pair of reads gave a rate (none saw the
    engines, or one did but none after it saw a lookup), takes every lookup they counted; a read that is
    not the last still waits for a window."""
    api = PodList()
    with exporters(1) as (engine,):
        Counter("rawmm_materialize_cache_hits", "", registry=engine.registry).inc(30)
        Counter("rawmm_materialize_cache_misses", "", registry=engine.registry).inc(10)
        api.pods = [pod("exp-engine-0", "engine", "http", engine.port)]
        assert ProgressReader(api).read("ml", "exp", Progress()).cache_hit_rate is None
        assert ProgressReader(api).read("ml", "exp", Progress(), last=True).cache_hit_rate == 0.75
        seen = ProgressReader(api)
        assert seen.read("ml", "exp", Progress()).cache_hit_rate is None  # its traffic all came before
        assert seen.read("ml", "exp", Progress()).cache_hit_rate is None  # none since
        assert seen.read("ml", "exp", Progress(), last=True).cache_hit_rate == 0.75
        # a rate the run had stands: the last window simply saw no lookups
        assert seen.read("ml", "exp", Progress(cache_hit_rate=0.5), last=True).cache_hit_rate == 0.5


class SlowCollector:
    """A collector that answers after `delay` seconds, as a pod's endpoint on a loaded node."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def collect(self) -> Iterator[Any]:
        time.sleep(self.delay)
        return iter(())


def test_the_read_that_ends_a_run_waits_longer_for_a_slow_pod() -> None:
    """The last read is the run's only chance to be seen: it waits `last_timeout` where the others give up."""
    api = PodList()
    with exporters(1) as (engine,):
        Counter("rawmm_materialize_cache_hits", "", registry=engine.registry).inc(3)
        Counter("rawmm_materialize_cache_misses", "", registry=engine.registry).inc(1)
        engine.registry.register(SlowCollector(0.5))  # type: ignore[arg-type]
        api.pods = [pod("exp-engine-0", "engine", "http", engine.port)]
        reader = ProgressReader(api, timeout=0.1, last_timeout=5.0)
        assert reader.read("ml", "exp", Progress()).cache_hit_rate is None  # timed out: nothing read
        assert reader.read("ml", "exp", Progress(), last=True).cache_hit_rate == 0.75
