"""The store's write side: durability of a new file, and reuse of a file this process cannot touch."""

from __future__ import annotations

import os

import pytest
from retention_kit import age, png

from rawmm.contract import OffloadStore


def test_a_new_file_is_fsynced_before_its_name_is_published(
    offload_store: OffloadStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        events.append(("replace", str(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    stored = offload_store.put(png(1))
    [(first, synced), (second, renamed)] = events
    assert (first, second) == ("fsync", "replace")
    assert synced == renamed and renamed.endswith(".tmp")
    assert stored.path.read_bytes() == png(1)


def test_reusing_a_file_whose_mtime_cannot_be_set_writes_a_fresh_copy(
    offload_store: OffloadStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's file on a shared volume: its mtime would stay old and a collector would take it
    despite this use, so the writer replaces it with its own copy (same bytes, fresh mtime)."""
    stored = offload_store.put(png(2))
    age(stored.path, 7200)
    inode = stored.path.stat().st_ino
    real_utime = os.utime

    def utime(path: str, *args: object, **kwargs: object) -> None:
        if not args and not kwargs:  # the store's touch (set to now); the test's own aging passes times
            raise PermissionError(1, "Operation not permitted", str(path))
        real_utime(path, *args, **kwargs)

    monkeypatch.setattr(os, "utime", utime)
    again = offload_store.put(png(2))
    assert again.path == stored.path and again.path.read_bytes() == png(2)
    assert stored.path.stat().st_ino != inode
    again_by_uri = offload_store.put(stored.uri)
    assert again_by_uri.path == stored.path
