"""Garbage collection of the offload store: remove images unused for longer than a bound, except those kept.

An image's mtime is its last use: ``OffloadStore.put`` creates it fresh or touches it on reuse. A pass
removes a stored file when its mtime is older than ``older_than`` and its hash is not in ``keep`` (the
images that rollout batches still waiting for training reference: ``rawmm.rl.gc`` computes them), and
sweeps temporary files of dead writers. Directories and lock files are never removed.

Protocol against concurrent writers (a put re-offloading an image while a pass removes it). A plain
check-then-unlink would lose a reuse landing between the two: the writer's touch succeeds, it ships a
ref, and the unlink, decided on the old mtime, deletes the file under it. So:

1. Writers touch a file older than ``REUSE_UNLOCKED_AGE_S`` only under its fan-out directory's shared
   lock (``directory_lock``); a pass re-stats and unlinks its candidates in a directory under the
   exclusive lock. A reuse of an old file thus lands wholly before the pass's last look (the fresh mtime
   keeps the file) or wholly after its unlink (the touch fails, and the writer writes the file anew before
   it returns the ref).
2. Younger files are touched lock-free, and a pass never takes them: ``older_than`` is at least
   ``MIN_OLDER_THAN_S`` = 2 x ``REUSE_UNLOCKED_AGE_S``, so a file a writer still sees as young is five
   minutes away from collectable; that margin absorbs clock skew between hosts and a writer stalled between
   its stat and its touch.
3. A new file is created with a fresh mtime, so the lock-free create path cannot race a pass either.
4. ``keep`` is computed before the scan. A batch written during the pass references images put (created
   or touched) during its rollout, so they are safe as long as ``older_than`` exceeds the time from an
   image's last put to its batch landing on the volume.

Readers never lock: a referenced image is either young or in ``keep``. A pass killed at any point leaves a
consistent store: each unlink is atomic, the kernel drops a dead holder's flock, and the next pass simply
finds what is left. Temporary files older than ``STALE_TEMP_AGE_S`` belong to dead writers (a live write
takes milliseconds); a writer stalled longer fails its rename loudly rather than publishing anything.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from rawmm.contract.retention_bounds import check_older_than
from rawmm.contract.store import directory_lock, is_temp_name, stored_sha

STALE_TEMP_AGE_S = 3600.0
_FANOUT_RE = re.compile(r"[0-9a-f]{2}")


@dataclass
class GCReport:
    """What one pass found and did (in a dry run: what it would have done)."""

    dry_run: bool
    scanned_files: int = 0  # stored images seen
    removed_files: int = 0
    removed_bytes: int = 0
    temps_removed: int = 0
    temp_bytes: int = 0
    kept_needed: int = 0  # old enough to go, but referenced by a batch still needed
    kept_reused: int = 0  # old when scanned, reused before the pass got to them
    remaining_files: int = 0  # stored images left after the pass
    remaining_bytes: int = 0
    seconds: float = 0.0
    removed_paths: list[str] = field(default_factory=list)  # images and temps, in removal order

    @property
    def freed_bytes(self) -> int:
        return self.removed_bytes + self.temp_bytes


@dataclass(frozen=True)
class _Candidate:
    path: str
    size: int


def collect(
    root: str | Path,
    *,
    older_than: float,
    keep: Collection[str] = frozenset(),
    dry_run: bool = False,
) -> GCReport:
    """One pass over the store at ``root``. ``keep`` holds sha256 hex prefixes (``mm_hash`` values, 32
    characters) of images to keep whatever their age; ``dry_run`` changes nothing (no lock files either)."""
    check_older_than(older_than)
    started = time.perf_counter()
    report = GCReport(dry_run=dry_run)
    started_at = time.time()
    cutoff, temp_cutoff = started_at - older_than, started_at - STALE_TEMP_AGE_S
    prefixes = {len(k) for k in keep}
    for directory in _fanout_dirs(Path(root)):
        candidates, temps = _scan(directory, cutoff, temp_cutoff, keep, prefixes, report)
        for temp in temps:
            if dry_run or _unlink(temp.path):
                report.temps_removed += 1
                report.temp_bytes += temp.size
                report.removed_paths.append(temp.path)
        if dry_run:
            for candidate in candidates:
                _count_removed(report, candidate)
        elif candidates:
            with directory_lock(directory, exclusive=True):
                for candidate in candidates:
                    _remove_if_unused(candidate, cutoff, report)
    report.remaining_files -= report.removed_files
    report.remaining_bytes -= report.removed_bytes
    report.seconds = time.perf_counter() - started
    return report


def _fanout_dirs(root: Path) -> list[str]:
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return [f"{root}/{name}" for name in sorted(names) if _FANOUT_RE.fullmatch(name)]


def _scan(
    directory: str,
    cutoff: float,
    temp_cutoff: float,
    keep: Collection[str],
    prefixes: set[int],
    report: GCReport,
) -> tuple[list[_Candidate], list[_Candidate]]:
    """The directory's collectable images and stale temps; counts every stored image as remaining."""
    candidates, temps = [], []
    with os.scandir(directory) as entries:
        for entry in entries:
            sha = stored_sha(entry.name)
            if sha is None and not is_temp_name(entry.name):
                continue  # the lock file, or something the store did not write: never touched
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if sha is None:
                if info.st_mtime < temp_cutoff:
                    temps.append(_Candidate(entry.path, info.st_size))
                continue
            report.scanned_files += 1
            report.remaining_files += 1
            report.remaining_bytes += info.st_size
            if info.st_mtime >= cutoff:
                continue
            if any(sha[:n] in keep for n in prefixes):
                report.kept_needed += 1
            else:
                candidates.append(_Candidate(entry.path, info.st_size))
    return candidates, temps


def _remove_if_unused(candidate: _Candidate, cutoff: float, report: GCReport) -> None:
    """Under the directory's exclusive lock: a last look at the mtime, then the unlink."""
    try:
        reused = os.stat(candidate.path).st_mtime >= cutoff
    except FileNotFoundError:
        reused = False
    if reused:
        report.kept_reused += 1
    elif _unlink(candidate.path):
        _count_removed(report, candidate)
    else:  # removed meanwhile by hand or by another pass: not ours, but no longer there either
        report.remaining_files -= 1
        report.remaining_bytes -= candidate.size


def _count_removed(report: GCReport, candidate: _Candidate) -> None:
    report.removed_files += 1
    report.removed_bytes += candidate.size
    report.removed_paths.append(candidate.path)


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
