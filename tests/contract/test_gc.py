"""Garbage collection of the offload store: what a pass removes, what it keeps, and its race with writers."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from retention_kit import HOUR, age, blocked_on, png, poll

from rawmm.contract import OffloadStore
from rawmm.contract.gc import STALE_TEMP_AGE_S, collect
from rawmm.contract.retention_bounds import MIN_OLDER_THAN_S, REUSE_UNLOCKED_AGE_S
from rawmm.contract.store import GC_LOCK_NAME, StoredImage, directory_lock


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root` (lock files included) with its size and mtime in ns."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


@pytest.fixture
def aged_store(offload_store: OffloadStore) -> Iterator[tuple[OffloadStore, list[StoredImage]]]:
    images = [offload_store.put(png(i)) for i in range(6)]
    for image in images:
        age(image.path, 2 * HOUR)
    yield offload_store, images


def test_a_pass_removes_old_unneeded_images_and_keeps_needed_and_young_ones(
    aged_store: tuple[OffloadStore, list[StoredImage]],
) -> None:
    store, images = aged_store
    needed, young = images[0], images[1]
    age(young.path, MIN_OLDER_THAN_S / 2)
    gone = images[2:]

    report = collect(store.root, older_than=HOUR, keep={needed.mm_hash})

    assert needed.path.exists() and young.path.exists()
    assert not any(image.path.exists() for image in gone)
    assert sorted(report.removed_paths) == sorted(str(image.path) for image in gone)
    assert report.removed_files == len(gone)
    assert report.removed_bytes == sum(len(png(i)) for i in range(2, 6))
    assert report.kept_needed == 1
    assert (report.remaining_files, report.remaining_bytes) == (2, len(png(0)) + len(png(1)))
    assert report.scanned_files == 6


def test_the_bound_is_the_last_use_a_reuse_renews_it(
    aged_store: tuple[OffloadStore, list[StoredImage]],
) -> None:
    store, images = aged_store
    reused = store.put(png(3))  # re-offloading old bytes touches the file
    assert reused.path == images[3].path
    report = collect(store.root, older_than=HOUR)
    assert images[3].path.exists()
    assert report.removed_files == len(images) - 1


def test_a_dry_run_lists_what_a_pass_would_remove_and_changes_nothing(
    aged_store: tuple[OffloadStore, list[StoredImage]],
) -> None:
    store, images = aged_store
    temp = images[0].path.parent / f".{images[0].path.name}.{'0' * 16}.tmp"
    temp.write_bytes(b"partial")
    age(temp, STALE_TEMP_AGE_S + 60)
    before = snapshot(store.root)

    dry = collect(store.root, older_than=HOUR, keep={images[1].mm_hash}, dry_run=True)

    assert snapshot(store.root) == before  # not even a lock file appears
    real = collect(store.root, older_than=HOUR, keep={images[1].mm_hash})
    assert sorted(dry.removed_paths) == sorted(real.removed_paths)
    assert (dry.removed_files, dry.removed_bytes, dry.temps_removed) == (
        real.removed_files,
        real.removed_bytes,
        real.temps_removed,
    )
    assert dry.dry_run and not real.dry_run


def test_stale_temps_are_swept_but_a_live_writers_temp_and_foreign_files_stay(
    offload_store: OffloadStore,
) -> None:
    stored = offload_store.put(png(1))
    directory = stored.path.parent
    stale = directory / f".{stored.path.name}.{'a' * 16}.tmp"
    live = directory / f".{stored.path.name}.{'b' * 16}.tmp"
    foreign = directory / "notes.txt"
    for path in (stale, live, foreign):
        path.write_bytes(b"x" * 10)
    age(stale, STALE_TEMP_AGE_S + 60)
    age(foreign, 10 * HOUR)

    report = collect(offload_store.root, older_than=HOUR)

    assert not stale.exists()
    assert live.exists() and foreign.exists() and stored.path.exists()
    assert (report.temps_removed, report.temp_bytes) == (1, 10)
    assert report.freed_bytes == 10


def test_a_bound_a_lock_free_reuse_could_race_is_refused(offload_store: OffloadStore) -> None:
    with pytest.raises(ValueError, match="at least"):
        collect(offload_store.root, older_than=MIN_OLDER_THAN_S - 1)
    assert MIN_OLDER_THAN_S >= 2 * REUSE_UNLOCKED_AGE_S


def test_a_reuse_racing_the_unlink_is_never_lost(
    aged_store: tuple[OffloadStore, list[StoredImage]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer re-offloads an image between the pass's decision and its unlink: after the pass, the
    writer's put has returned and the file it named exists (and verifies)."""
    store, images = aged_store
    target = images[2]
    lock_file = target.path.parent / GC_LOCK_NAME
    real_unlink = os.unlink
    writer: dict[str, object] = {}

    def put_again() -> None:
        writer["stored"] = store.put(png(2))

    def unlink_with_a_racing_writer(path: str, *args: object, **kwargs: object) -> None:
        if path == str(target.path) and "thread" not in writer:
            thread = writer["thread"] = threading.Thread(target=put_again)
            thread.start()
            # The writer either queues on the directory lock this pass holds, or (if reuse ignored the
            # lock) has already touched and returned: either way, now the pass unlinks.
            poll(lambda: blocked_on(lock_file) or not thread.is_alive(), "the writer to block or finish")
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink_with_a_racing_writer)
    collect(store.root, older_than=HOUR)
    thread = writer["thread"]
    assert isinstance(thread, threading.Thread)
    thread.join(timeout=20)
    stored = writer["stored"]
    assert isinstance(stored, StoredImage) and stored.path == target.path
    assert hashlib.sha256(target.path.read_bytes()).hexdigest() == target.sha256


def test_reusing_a_young_image_takes_no_lock_and_an_old_one_waits_for_the_pass(
    offload_store: OffloadStore,
) -> None:
    young = offload_store.put(png(1))
    old = offload_store.put(png(2))
    age(old.path, 2 * HOUR)
    results: dict[str, StoredImage] = {}

    def put(name: str, seed: int) -> threading.Thread:
        thread = threading.Thread(target=lambda: results.__setitem__(name, offload_store.put(png(seed))))
        thread.start()
        return thread

    with contextlib.ExitStack() as locks:
        for directory in {young.path.parent, old.path.parent}:  # a collector holds both directories
            locks.enter_context(directory_lock(directory, exclusive=True))
        fast = put("young", 1)
        fast.join(timeout=20)
        assert not fast.is_alive() and "young" in results  # the hot path never waits for a collector
        slow = put("old", 2)
        poll(lambda: blocked_on(old.path.parent / GC_LOCK_NAME), "the old image's reuse to queue on the lock")
        assert "old" not in results
    slow.join(timeout=20)
    assert results["old"].path == old.path
    assert time.time() - old.path.stat().st_mtime < REUSE_UNLOCKED_AGE_S  # the reuse renewed it


def test_a_pass_over_a_missing_or_empty_root_removes_nothing(tmp_path: Path) -> None:
    assert collect(tmp_path / "absent", older_than=HOUR).removed_files == 0
    assert collect(OffloadStore(tmp_path / "empty").root, older_than=HOUR).scanned_files == 0


def test_a_reuse_between_the_scan_and_the_lock_keeps_the_image(
    aged_store: tuple[OffloadStore, list[StoredImage]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan saw the image old; a writer reuses it before the pass takes the directory's lock: the
    pass's last look under the lock sees the new mtime and keeps it."""
    import rawmm.contract.gc as gc

    store, images = aged_store
    target = images[4]
    real_lock = gc.directory_lock

    def reuse_then_lock(directory: str | Path, *, exclusive: bool):  # type: ignore[no-untyped-def]
        if Path(directory) == target.path.parent:
            store.put(png(4))
        return real_lock(directory, exclusive=exclusive)

    monkeypatch.setattr(gc, "directory_lock", reuse_then_lock)
    report = collect(store.root, older_than=HOUR)
    assert target.path.exists()
    assert report.kept_reused >= 1
