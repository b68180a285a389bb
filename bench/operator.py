"""Operator latency: RLRun created -> every child present, one run at a time vs 50 runs at once.

Runs the real operator (kopf, its own thread and event loop, as in production) against the kmock-based
API emulator in this process, and prints median / p95 for both cases and their ratio.

    python bench/operator.py [--sequential 10] [--burst 50]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from rawmm_operator.builders import RunRef, build_children
from rawmm_operator.handlers import LoopTiming
from rawmm_operator.spec import parse_spec
from rawmm_operator.testing import Cluster, emulated_cluster, running_operator

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


def expected_children(name: str) -> list[tuple[str, str]]:
    manifests = build_children(RunRef(name, NAMESPACE, "-"), parse_spec(name, SPEC))
    return [(RESOURCES[m["kind"]], m["metadata"]["name"]) for m in manifests]


async def create_and_wait(cluster: Cluster, name: str) -> float:
    """Seconds from the create request to the last child appearing."""
    children = expected_children(name)
    body = {"apiVersion": "rawmm.dev/v1alpha1", "kind": "RLRun", "metadata": {"name": name}, "spec": SPEC}
    started = time.perf_counter()
    response = await cluster.emulator.post(
        f"/apis/rawmm.dev/v1alpha1/namespaces/{NAMESPACE}/rlruns", json=body
    )
    assert response.status < 300, await response.text()
    while not all(cluster.object(resource, NAMESPACE, child) for resource, child in children):
        if time.perf_counter() - started > 120:
            raise TimeoutError(f"{name}: children missing after 120 s")
        await asyncio.sleep(0.002)
    return time.perf_counter() - started


def p95(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.95 * len(values)) - 1)]


async def bench(sequential: int, burst: int) -> None:
    async with emulated_cluster() as cluster, running_operator(cluster, timing=LoopTiming(resync_seconds=30)):
        one_by_one = [await create_and_wait(cluster, f"seq-{i}") for i in range(sequential)]
        started = time.perf_counter()
        together = await asyncio.gather(*(create_and_wait(cluster, f"burst-{i}") for i in range(burst)))
        wall = time.perf_counter() - started

    print(
        f"RLRun created -> all {len(expected_children('x'))} children present (kopf operator vs kmock emulator)"
    )
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequential", type=int, default=10, help="runs created one after another")
    parser.add_argument("--burst", type=int, default=50, help="runs created at once")
    args = parser.parse_args()
    asyncio.run(bench(args.sequential, args.burst))


if __name__ == "__main__":
    main()
