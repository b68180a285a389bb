"""Operator latency: RLRun created -> every child present, one run at a time vs 50 runs at once.

Two API servers (--server):
- emulator: the kmock-based API emulator in this process, the operator (kopf) in a thread of it: the
  operator's own cost, no network.
- real: the test control plane of tests/kube (etcd, kube-apiserver, controller-manager, scheduler, kwok's
  fake nodes; `make tools` builds them) and the real `rawmm operator` process: what a cluster adds (TLS,
  etcd writes, admission, watches, and the controllers reacting to the children).

Prints median / p95 for both cases and their ratio.

    python bench/operator.py [--server emulator|real] [--sequential 10] [--burst 50]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rawmm_operator.catalogue import build_children
from rawmm_operator.handlers import LoopTiming
from rawmm_operator.objects import RunRef
from rawmm_operator.spec import parse_spec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the emulator and the test cluster are test code, not the product

from kube.emulator import Cluster, emulated_cluster, running_operator  # noqa: E402

NAMESPACE = "bench"
SPEC: dict[str, Any] = {
    "model": {"name": "Qwen/Qwen3-VL-4B-Instruct", "preset": "qwen3_vl"},
    "inference": {"replicas": 2, "materializeCacheSize": "4Gi"},
    "trainer": {"gpusPerNode": 8},
}
RESOURCES = {
    "PersistentVolumeClaim": "v1/persistentvolumeclaims",
    "ConfigMap": "v1/configmaps",
    "Service": "v1/services",
    "StatefulSet": "apps/v1/statefulsets",
    "Job": "batch/v1/jobs",
    "PodMonitor": "monitoring.coreos.com/v1/podmonitors",
}
TIMEOUT = 120


def expected_children(name: str) -> list[tuple[str, str]]:
    """(kind, name) of every child the operator builds for this run."""
    manifests = build_children(RunRef(name, NAMESPACE, "-"), parse_spec(name, SPEC))
    return [(m["kind"], m["metadata"]["name"]) for m in manifests]


def rlrun(name: str) -> dict[str, Any]:
    return {"apiVersion": "rawmm.dev/v1alpha1", "kind": "RLRun", "metadata": {"name": name}, "spec": SPEC}


def p95(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.95 * len(values)) - 1)]


def report(server: str, one_by_one: list[float], together: list[float], wall: float) -> None:
    burst = len(together)
    print(f"RLRun created -> all {len(expected_children('x'))} children present (kopf operator vs {server})")
    print(f"{'case':<26}{'runs':>6}{'median ms':>12}{'p95 ms':>10}")
    for label, values in (("one at a time", one_by_one), (f"{burst} at once", together)):
        print(
            f"{label:<26}{len(values):>6}{statistics.median(values) * 1e3:>12.1f}{p95(values) * 1e3:>10.1f}"
        )
    print(f"{burst} at once: all children of all runs present after {wall:.2f} s ({burst / wall:.1f} runs/s)")
    print(
        f"ratio {burst} at once / one at a time: median {statistics.median(together) / statistics.median(one_by_one):.1f}x,"
        f" p95 {p95(together) / p95(one_by_one):.1f}x"
    )


# --- the emulator ----------------------------------------------------------------------------------------


async def emulated_create_and_wait(cluster: Cluster, name: str) -> float:
    """Seconds from the create request to the last child appearing."""
    children = [(RESOURCES[kind], child) for kind, child in expected_children(name)]
    started = time.perf_counter()
    response = await cluster.emulator.post(
        f"/apis/rawmm.dev/v1alpha1/namespaces/{NAMESPACE}/rlruns", json=rlrun(name)
    )
    assert response.status < 300, await response.text()
    while not all(cluster.object(resource, NAMESPACE, child) for resource, child in children):
        if time.perf_counter() - started > TIMEOUT:
            raise TimeoutError(f"{name}: children missing after {TIMEOUT} s")
        await asyncio.sleep(0.002)
    return time.perf_counter() - started


async def emulator_bench(sequential: int, burst: int) -> None:
    async with emulated_cluster() as cluster, running_operator(cluster, timing=LoopTiming(resync_seconds=30)):
        one_by_one = [await emulated_create_and_wait(cluster, f"seq-{i}") for i in range(sequential)]
        started = time.perf_counter()
        together = await asyncio.gather(
            *(emulated_create_and_wait(cluster, f"burst-{i}") for i in range(burst))
        )
        wall = time.perf_counter() - started
        # Printed before the operator stops: kopf's shutdown with 60 runs can outlast the emulator's 30 s.
        report("the kmock emulator", one_by_one, list(together), wall)


# --- the real control plane ------------------------------------------------------------------------------


class FirstSeen:
    """When each child was first seen, from one watch per kind (started before any run is created)."""

    def __init__(self, api: Any, namespace: str) -> None:
        from kubernetes import client as k8s

        core, apps, batch, custom = (
            k8s.CoreV1Api(api),
            k8s.AppsV1Api(api),
            k8s.BatchV1Api(api),
            k8s.CustomObjectsApi(api),
        )
        self.lists: dict[str, Callable[..., Any]] = {
            "PersistentVolumeClaim": core.list_namespaced_persistent_volume_claim,
            "ConfigMap": core.list_namespaced_config_map,
            "Service": core.list_namespaced_service,
            "StatefulSet": apps.list_namespaced_stateful_set,
            "Job": batch.list_namespaced_job,
            "PodMonitor": lambda **kw: custom.list_namespaced_custom_object(
                "monitoring.coreos.com", "v1", plural="podmonitors", **kw
            ),
        }
        self.namespace = namespace
        self.seen: dict[tuple[str, str], float] = {}
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._watch, args=(kind,), daemon=True) for kind in self.lists
        ]

    def _watch(self, kind: str) -> None:
        from kubernetes import watch

        listed = self.lists[kind](namespace=self.namespace)
        version = (
            listed["metadata"]["resourceVersion"]
            if isinstance(listed, dict)
            else listed.metadata.resource_version
        )
        self.ready.release()
        while not self.stopping.is_set():
            for event in watch.Watch().stream(
                self.lists[kind], namespace=self.namespace, resource_version=version, timeout_seconds=5
            ):
                obj = event["object"]
                meta = obj["metadata"] if isinstance(obj, dict) else obj.metadata.to_dict()
                version = meta.get("resourceVersion") or meta.get("resource_version")
                if event["type"] == "ADDED":
                    self.seen.setdefault((kind, meta["name"]), time.perf_counter())

    def start(self) -> None:
        self.ready = threading.Semaphore(0)
        for thread in self.threads:
            thread.start()
        for _ in self.threads:
            assert self.ready.acquire(timeout=30), "a watch did not start"

    def wait(self, name: str, started: float) -> float:
        children = expected_children(name)
        while not all(child in self.seen for child in children):
            if time.perf_counter() - started > TIMEOUT:
                raise TimeoutError(f"{name}: children missing after {TIMEOUT} s")
            time.sleep(0.002)
        return max(self.seen[child] for child in children) - started


def real_bench(sequential: int, burst: int) -> None:
    from kube.cluster import start_cluster
    from kube.installs import apply_crd
    from kubernetes import client as k8s

    with (
        tempfile.TemporaryDirectory(prefix="rawmm-bench-") as tmp,
        start_cluster(Path(tmp) / "cluster") as cluster,
    ):
        apply_crd(cluster)
        cluster.monitoring_crds(True)
        namespace = cluster.namespace(NAMESPACE)
        api = cluster.api_client()
        seen = FirstSeen(api, namespace)
        seen.start()
        runs = k8s.CustomObjectsApi(api)

        def create_and_wait(name: str) -> float:
            started = time.perf_counter()
            runs.create_namespaced_custom_object("rawmm.dev", "v1alpha1", namespace, "rlruns", rlrun(name))
            return seen.wait(name, started)

        with cluster.operator(namespace=namespace, args=("--resync-seconds=30",)):
            one_by_one = [create_and_wait(f"seq-{i}") for i in range(sequential)]
            started = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(burst) as pool:
                together = list(pool.map(create_and_wait, [f"burst-{i}" for i in range(burst)]))
            wall = time.perf_counter() - started
        seen.stopping.set()
        api.close()
    report("kube-apiserver", one_by_one, together, wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=["emulator", "real"], default="emulator", help="the API server")
    parser.add_argument("--sequential", type=int, default=10, help="runs created one after another")
    parser.add_argument("--burst", type=int, default=50, help="runs created at once")
    args = parser.parse_args()
    if args.server == "real":
        real_bench(args.sequential, args.burst)
    else:
        asyncio.run(emulator_bench(args.sequential, args.burst))


if __name__ == "__main__":
    main()
