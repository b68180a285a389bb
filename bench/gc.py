"""Offload GC (`rawmm.contract.gc`): how long a pass takes over a store of N files, and what reuse costs.

1. Passes over stores of 25k, 50k and 100k small files (the store's naming, 256 fan-out directories; half
   the files unused for two hours, a tenth of those kept as if a pending batch referenced them): a dry
   run (scan only), the real pass (removes ~45%), and a pass over what is left (nothing to remove).
   Seconds, files scanned per second and files removed per second; a pass is linear in the files when
   files/s stays flat as N grows.
2. The writer side the protocol adds, on the temp directory's disk: a reuse of a young file (stat + utime,
   lock-free) vs a reuse of an old one (under the directory's shared flock), and a new 0.5 MB write with
   and without the fsync before its rename.

    .venv/bin/python bench/gc.py [--sizes 25000,50000,100000] [--dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

from PIL import Image

from rawmm.contract import OffloadStore
from rawmm.contract.files import write_atomically  # the write path itself, without a PNG encode per call
from rawmm.contract.gc import GCReport, collect

HOUR = 3600.0


def build_store(root: Path, n: int) -> set[str]:
    """N 64-byte files named as the store names them; even ones two hours old. Returns the kept hashes."""
    old = time.time() - 2 * HOUR
    keep: set[str] = set()
    made: set[str] = set()
    for i in range(n):
        sha = hashlib.sha256(i.to_bytes(8, "little")).hexdigest()
        directory = root / sha[:2]
        if sha[:2] not in made:
            directory.mkdir(parents=True, exist_ok=True)
            made.add(sha[:2])
        path = directory / f"{sha}.png"
        path.write_bytes(sha.encode())
        if i % 2 == 0:
            os.utime(path, (old, old))
            if i % 20 == 0:
                keep.add(sha[:32])
    return keep


def timed(work: Callable[[], GCReport]) -> tuple[GCReport, float]:
    started = time.perf_counter()
    report = work()
    return report, time.perf_counter() - started


def passes(base: Path, sizes: list[int]) -> None:
    print("1. GC passes (64-byte files, 256 fan-out directories; half old, a tenth of those kept)")
    print(f"{'files':>8} {'build s':>8} | {'dry run s':>9} {'files/s':>9} | {'pass s':>7} {'files/s':>9} "
          f"{'removed':>8} {'removed/s':>9} | {'rerun s':>7} {'files/s':>9}")  # fmt: skip
    for n in sizes:
        root = base / f"store-{n}"
        started = time.perf_counter()
        keep = build_store(root, n)
        build_s = time.perf_counter() - started
        dry, dry_s = timed(lambda: collect(root, older_than=HOUR, keep=keep, dry_run=True))  # noqa: B023
        real, real_s = timed(lambda: collect(root, older_than=HOUR, keep=keep))  # noqa: B023
        again, again_s = timed(lambda: collect(root, older_than=HOUR, keep=keep))  # noqa: B023
        assert dry.removed_files == real.removed_files and again.removed_files == 0
        assert real.remaining_files == n - real.removed_files == again.scanned_files
        print(f"{n:>8} {build_s:>8.2f} | {dry_s:>9.2f} {n / dry_s:>9.0f} | {real_s:>7.2f} {n / real_s:>9.0f} "
              f"{real.removed_files:>8} {real.removed_files / real_s:>9.0f} | {again_s:>7.2f} "
              f"{again.scanned_files / again_s:>9.0f}")  # fmt: skip
        shutil.rmtree(root)


def per_call_us(work: Callable[[], object], rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        work()
        samples.append((time.perf_counter() - started) * 1e6)
    return statistics.median(samples)


def writer_costs(base: Path) -> None:
    print(f"\n2. Writer side (median per put, under {base})")
    store = OffloadStore(base / "writer")
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buffer, format="PNG")
    image = buffer.getvalue()
    stored = store.put(image)
    young_us = per_call_us(lambda: store.put(image), 2000)

    def reuse_old() -> None:
        old = time.time() - 2 * HOUR
        os.utime(stored.path, (old, old))
        store.put(image)

    def age_only() -> None:
        old = time.time() - 2 * HOUR
        os.utime(stored.path, (old, old))

    old_us = per_call_us(reuse_old, 2000) - per_call_us(age_only, 2000)
    print(f"   reuse of a young image (lock-free):   {young_us:6.1f} us  (header parse, sha256, stat, utime)")
    print(
        f"   reuse of an old image (shared flock): {old_us:6.1f} us  (the same plus the lock; aging excluded)"
    )

    payload = os.urandom(512 * 1024)
    # New bytes each call: a reuse would not write. The first 32 bytes vary; the rest are incompressible.
    counter = iter(range(10**9))

    def new_write() -> None:
        sha = hashlib.sha256(next(counter).to_bytes(8, "little")).hexdigest()
        directory = f"{store.root}/{sha[:2]}"
        write_atomically(f"{directory}/{sha}.img", payload)

    with_fsync = per_call_us(new_write, 100)
    with mock.patch("os.fsync"):
        without = per_call_us(new_write, 100)
    print(f"   new 0.5 MB file: {with_fsync / 1000:6.2f} ms with fsync, {without / 1000:6.2f} ms without "
          "(on NFS, close() flushes and commits anyway)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="25000,50000,100000")
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None,
        help="where to build the stores: tmpfs by default (the pass's own cost); a volume's path to include "
        "its metadata I/O",
    )
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="rawmm-bench-gc-", dir=args.dir))
    print(f"stores under {base}")
    try:
        passes(base, [int(s) for s in args.sizes.split(",")])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    disk = Path(tempfile.mkdtemp(prefix="rawmm-bench-gc-"))  # a disk, not tmpfs: fsync has work to do there
    try:
        writer_costs(disk)
    finally:
        shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()
