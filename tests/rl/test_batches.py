"""Rollout batches on the shared volume: written whole, read back, waited for with a deadline."""

from __future__ import annotations

from pathlib import Path

import pytest

from rawmm.contract.shared_dir import BatchTimeout, batch_path, written_steps
from rawmm.rl.batches import read_batch, wait_for_batch, write_batch
from rawmm.rl.samples import RolloutBatch


def test_a_written_batch_reads_back_and_counts_as_written(tmp_path: Path) -> None:
    rollouts = tmp_path / "rollouts"
    path = write_batch(rollouts, RolloutBatch(step=3, samples=[], metadata={"reward_mean": 0.5}))
    assert path == batch_path(rollouts, 3) and written_steps(rollouts) == [3]
    assert read_batch(rollouts, 3) == RolloutBatch(step=3, samples=[], metadata={"reward_mean": 0.5})
    assert wait_for_batch(rollouts, 3, timeout_s=0) == read_batch(rollouts, 3)


def test_waiting_for_a_batch_times_out_and_checks_the_step(tmp_path: Path) -> None:
    rollouts = tmp_path / "rollouts"
    with pytest.raises(BatchTimeout, match="step 3"):
        wait_for_batch(rollouts, 3, timeout_s=0.05, poll_s=0.01)
    write_batch(rollouts, RolloutBatch(step=4, samples=[]))
    batch_path(rollouts, 4).rename(batch_path(rollouts, 3))
    with pytest.raises(ValueError, match="holds the batch of step 4, expected 3"):
        wait_for_batch(rollouts, 3, timeout_s=1)
