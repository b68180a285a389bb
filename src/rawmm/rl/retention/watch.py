"""GC passes of a run: one pass (needed images, then the collection), and the loop that runs one per step."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rawmm.contract.gc import GCReport, collect
from rawmm.contract.shared_dir import SharedDir, latest_step
from rawmm.rl.retention.needed import NeededImages, needed_images


@dataclass(frozen=True)
class PassResult:
    report: GCReport
    needed: NeededImages | None  # None without a shared directory: age alone decides

    def event(self) -> dict[str, Any]:
        """The pass as one JSON-safe log event (without the list of removed paths)."""
        report = {k: v for k, v in asdict(self.report).items() if k != "removed_paths"}
        needed = self.needed
        return {
            "event": "gc",
            **report,
            "freed_bytes": self.report.freed_bytes,
            "latest_step": needed.latest_step if needed else None,
            "needed_steps": list(needed.steps) if needed else None,
            "needed_images": len(needed.mm_hashes) if needed else None,
        }


def run_pass(
    offload_root: Path,
    shared_dir: Path | None,
    *,
    older_than: float,
    keep_steps: int = 0,
    dry_run: bool = False,
) -> PassResult:
    """Read what the batches need, then collect the rest (in that order: see `rawmm.contract.gc`)."""
    needed = needed_images(shared_dir, keep_steps=keep_steps) if shared_dir is not None else None
    report = collect(
        offload_root,
        older_than=older_than,
        keep=needed.mm_hashes if needed else frozenset(),
        dry_run=dry_run,
    )
    return PassResult(report=report, needed=needed)


def watch(
    offload_root: Path,
    shared_dir: Path,
    *,
    older_than: float,
    keep_steps: int,
    final_step: int,
    on_pass: Callable[[PassResult], None],
    on_error: Callable[[Exception], None],
    poll_s: float = 1.0,
) -> None:
    """A pass at start and after every new checkpoint; returns after the pass that follows `final_step`.

    A failed pass (e.g. a batch that cannot be read) is reported and retried at the next checkpoint.
    """
    checkpoints = SharedDir(shared_dir).checkpoints_dir
    done: int | None = None
    while True:
        step = latest_step(checkpoints)
        if step != done:
            done = step
            try:
                on_pass(run_pass(offload_root, shared_dir, older_than=older_than, keep_steps=keep_steps))
            except (OSError, ValueError) as exc:
                on_error(exc)
        if step >= final_step:
            return
        time.sleep(poll_s)
