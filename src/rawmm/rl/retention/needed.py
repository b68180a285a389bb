"""The images a run's rollout batches still need: every batch the trainer has not trained yet is kept whole."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rawmm.contract.shared_dir import SharedDir, latest_step, written_steps
from rawmm.rl.batches import read_batch


@dataclass(frozen=True)
class NeededImages:
    latest_step: int  # the newest checkpoint when the batches were read
    steps: tuple[int, ...]  # the batches read (needed: newer than the checkpoint, or among the kept ones)
    mm_hashes: frozenset[str]


def needed_images(shared_dir: Path, *, keep_steps: int = 0) -> NeededImages:
    """The `mm_hash` of every image in the batches of steps after `latest - keep_steps`.

    `latest` is read before the batches: a step trained meanwhile only keeps a little more than needed. A
    batch that cannot be read raises (`SampleError`, `OSError`), so a pass never runs on a partial view.
    """
    layout = SharedDir(Path(shared_dir))
    latest = latest_step(layout.checkpoints_dir)
    steps = tuple(s for s in written_steps(layout.rollouts_dir) if s > latest - keep_steps)
    hashes = {
        image.mm_hash
        for step in steps
        for sample in read_batch(layout.rollouts_dir, step).samples
        for image in sample.mm_refs
    }
    return NeededImages(latest_step=latest, steps=steps, mm_hashes=frozenset(hashes))
