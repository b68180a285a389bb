"""Rollout batches on the shared volume, one per step (where: `rawmm.contract.shared_dir`).

The orchestrator writes each batch atomically (temporary file in the same directory, then
`os.replace`), so a reader sees either nothing or the whole batch, never a partial file.
"""

from __future__ import annotations

from pathlib import Path

from rawmm.contract.files import write_atomically
from rawmm.contract.shared_dir import batch_path, wait_for_batch_file
from rawmm.rl.samples import RolloutBatch, decode_batch, encode_batch


def write_batch(rollouts_dir: Path, batch: RolloutBatch) -> Path:
    """Write the batch of `batch.step` atomically; returns its path."""
    path = batch_path(rollouts_dir, batch.step)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, encode_batch(batch))
    return path


def read_batch(rollouts_dir: Path, step: int) -> RolloutBatch:
    return decode_batch(batch_path(rollouts_dir, step).read_bytes())


def wait_for_batch(rollouts_dir: Path, step: int, *, timeout_s: float, poll_s: float = 0.2) -> RolloutBatch:
    """Step `step`'s batch once the orchestrator has written it (`BatchTimeout` after `timeout_s`)."""
    path = wait_for_batch_file(rollouts_dir, step, timeout_s=timeout_s, poll_s=poll_s)
    batch = read_batch(rollouts_dir, step)
    if batch.step != step:
        raise ValueError(f"{path} holds the batch of step {batch.step}, expected {step}")
    return batch
