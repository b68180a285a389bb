"""Prometheus metrics of the GC process (`rawmm gc --watch`): volume usage and what the passes freed."""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client import Counter, Gauge

from rawmm.contract.gc import GCReport

OFFLOAD_BYTES = Gauge(
    "rawmm_offload_bytes", "Bytes of the images in the offload store after the last GC pass"
)
OFFLOAD_FILES = Gauge("rawmm_offload_files", "Images in the offload store after the last GC pass")
VOLUME_CAPACITY_BYTES = Gauge(
    "rawmm_offload_volume_capacity_bytes", "Size of the file system of the offload store"
)
VOLUME_AVAILABLE_BYTES = Gauge(
    "rawmm_offload_volume_available_bytes", "Bytes still available on the file system of the offload store"
)
GC_FREED_BYTES = Counter("rawmm_offload_gc_freed_bytes", "Bytes freed by GC passes (images and stale temps)")
GC_REMOVED_FILES = Counter("rawmm_offload_gc_removed_files", "Images and stale temps removed by GC passes")
GC_LAST_RUN = Gauge(
    "rawmm_offload_gc_last_run_timestamp_seconds", "When the last GC pass finished (Unix time)"
)


def volume_bytes(root: Path) -> tuple[int, int]:
    """(capacity, available to this user) of the file system holding `root`."""
    info = os.statvfs(root)
    return info.f_blocks * info.f_frsize, info.f_bavail * info.f_frsize


def export(report: GCReport, root: Path) -> None:
    """Publish a finished (not dry-run) pass."""
    OFFLOAD_BYTES.set(report.remaining_bytes)
    OFFLOAD_FILES.set(report.remaining_files)
    capacity, available = volume_bytes(root)
    VOLUME_CAPACITY_BYTES.set(capacity)
    VOLUME_AVAILABLE_BYTES.set(available)
    GC_FREED_BYTES.inc(report.freed_bytes)
    GC_REMOVED_FILES.inc(report.removed_files + report.temps_removed)
    GC_LAST_RUN.set_to_current_time()
