"""The miss threads: one per CPU the process may use, its cgroup's quota included."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rawmm.materialize.cache import MaterializeCache
from rawmm.materialize.workers import cgroup_cpu_limit, usable_cpus


@pytest.mark.parametrize(
    ("files", "limit"),
    [
        ({"cpu.max": "150000 100000\n"}, 1.5),  # cgroup v2, a pod limited to 1500m
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4.0),  # v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
        ({"cpu.max": "garbage\n"}, None),
    ],
)
def test_the_cgroup_quota_is_read_from_v2_or_v1(
    tmp_path: Path, files: dict[str, str], limit: float | None
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_limit(tmp_path) == limit


def test_usable_cpus_are_the_affinity_capped_by_the_quota_rounded_up(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == affinity  # no quota
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU: still one thread
    assert usable_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text(f"{(affinity + 8) * 100000} 100000\n")  # more than it may run on
    assert usable_cpus(tmp_path) == affinity


@pytest.mark.parametrize("max_bytes", [0, 1000])
async def test_misses_run_on_the_miss_threads_at_most_one_per_usable_cpu(max_bytes: int) -> None:
    cache: MaterializeCache[bytes] = MaterializeCache(max_bytes, size_of=len)
    threads = usable_cpus()
    lock, running, peak, names = threading.Lock(), [0], [0], set()
    released = threading.Event()

    def work() -> bytes:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            names.add(threading.current_thread().name)
        released.wait(10)
        with lock:
            running[0] -= 1
        return b"x"

    misses = [asyncio.ensure_future(cache.get(f"k{index}", work)) for index in range(threads + 3)]
    async with asyncio.timeout(10):
        while running[0] < threads:  # every thread busy, the rest queued
            await asyncio.sleep(0.01)
    released.set()
    await asyncio.gather(*misses)
    assert peak[0] == threads
    assert all(name.startswith("rawmm-materialize") for name in names), names


FORK_PROBE = """
import os
from rawmm.materialize.workers import materialize_workers
assert materialize_workers().submit(os.getpid).result(5)  # the parent's pool has a thread now
child = os.fork()
if child == 0:
    try:
        os._exit(0 if materialize_workers().submit(os.getpid).result(5) == os.getpid() else 1)
    except Exception:
        os._exit(2)
_, status = os.waitpid(child, 0)
print(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_runs_misses_on_threads_of_its_own() -> None:
    out = subprocess.run([sys.executable, "-c", FORK_PROBE], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "0", (out.stdout, out.stderr)
