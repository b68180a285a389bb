"""The threads misses run on: one pool per process, as many threads as the CPUs this process may use.

A miss is CPU work that releases the GIL (decode, resize, patchify), so more threads than CPUs only share
the same cores and each carries another miss's scratch. asyncio's default executor has ``cpu_count() + 4``
threads, and ``cpu_count()`` is the node's: a pod limited to 8 CPUs on a 128-core GPU node would run 32
misses at once under a quota of 8 (on 2 CPUs, its 6 threads cost an 8-image request 6% more CPU than 2).
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
CGROUP_FS = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(cgroup_fs: Path = CGROUP_FS) -> float | None:
    """The CPUs this container's cgroup quota allows (cgroup v2 ``cpu.max``, else v1's CFS quota), or None
    without a quota. Read at the cgroup filesystem's root, which in a container with its own cgroup
    namespace (Kubernetes' default on cgroup v2) is the container's group; elsewhere (a host process, a
    quota on a parent group only) the affinity alone counts."""
    try:
        quota, period = (cgroup_fs / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((cgroup_fs / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup_fs / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cpus(cgroup_fs: Path = CGROUP_FS) -> int:
    """CPUs this process may run on (its affinity), capped by its cgroup's quota rounded up; at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = cgroup_cpu_limit(cgroup_fs)
    return max(1, min(cpus, math.ceil(limit))) if limit is not None else max(1, cpus)


@functools.cache
def materialize_workers() -> ThreadPoolExecutor:
    """The process's miss threads (created on first use, named ``rawmm-materialize``)."""
    return ThreadPoolExecutor(max_workers=usable_cpus(), thread_name_prefix="rawmm-materialize")


async def run_on_miss_thread(work: Callable[[], T]) -> T:
    """``work`` on one of the process's miss threads, awaited from the event loop."""
    return await asyncio.get_running_loop().run_in_executor(materialize_workers(), work)


# A forked child has none of the parent's threads: it makes a pool of its own (the inherited one would
# queue work for threads that are not there).
os.register_at_fork(after_in_child=materialize_workers.cache_clear)
