"""Rollout batches on the shared volume: `<shared_dir>/rollouts/step_<N>.msgpack`, one per step.

The orchestrator writes each batch atomically (temporary file in the same directory, then
`os.replace`), so a reader sees either nothing or the whole batch, never a partial file.
"""

from __future__ import annotations

import re
from pathlib import Path

from rawmm.rl.files import write_atomically
from rawmm.rl.samples import RolloutBatch, decode_batch, encode_batch

_BATCH_NAME = re.compile(r"^step_(\d+)\.msgpack$")


def batch_path(rollouts_dir: Path, step: int) -> Path:
    return Path(rollouts_dir) / f"step_{step}.msgpack"


def write_batch(rollouts_dir: Path, batch: RolloutBatch) -> Path:
    """Write `batch` as `step_<batch.step>.msgpack` atomically; returns its path."""
    rollouts_dir = Path(rollouts_dir)
    rollouts_dir.mkdir(parents=True, exist_ok=True)
    path = batch_path(rollouts_dir, batch.step)
    write_atomically(path, encode_batch(batch))
    return path


def read_batch(rollouts_dir: Path, step: int) -> RolloutBatch:
    return decode_batch(batch_path(rollouts_dir, step).read_bytes())


def written_steps(rollouts_dir: Path) -> list[int]:
    """Steps whose batch is on disk, ascending."""
    rollouts_dir = Path(rollouts_dir)
    if not rollouts_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in rollouts_dir.iterdir() if (m := _BATCH_NAME.match(p.name)))
