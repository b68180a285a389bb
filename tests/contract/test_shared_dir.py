"""The shared directory's layout (what the orchestrator, the trainer, retention and `rawmm run` agree on) and
the waits on it, each bounded by its timeout."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from rawmm.contract import shared_dir
from rawmm.contract.files import write_atomically
from rawmm.contract.shared_dir import (
    BatchTimeout,
    CheckpointTimeout,
    SharedDir,
    batch_path,
    checkpoint_dir,
    checkpoint_steps,
    latest_path,
    latest_step,
    staging_dir,
    train_state_dir,
    wait_for_batch_file,
    wait_for_checkpoint,
    written_steps,
)


@pytest.fixture
def shared(tmp_path: Path) -> SharedDir:
    return SharedDir(tmp_path / "shared")


def publish(shared: SharedDir, step: int) -> None:
    """What the trainer leaves: the step's directory, then `latest`."""
    checkpoint_dir(shared.checkpoints_dir, step).mkdir(parents=True)
    latest_path(shared.checkpoints_dir).write_text(f"{step}\n")


def test_the_layout_on_disk(shared: SharedDir) -> None:
    # The on-disk names other processes (and an engine told to load a checkpoint) rely on.
    root = shared.path
    assert (shared.offload_dir, shared.rollouts_dir, shared.checkpoints_dir) == (
        root / "images",
        root / "rollouts",
        root / "checkpoints",
    )
    assert batch_path(shared.rollouts_dir, 7) == root / "rollouts" / "step_7.msgpack"
    assert checkpoint_dir(shared.checkpoints_dir, 7) == root / "checkpoints" / "step_7"
    assert staging_dir(shared.checkpoints_dir, 7) == root / "checkpoints" / "step_7.tmp"
    assert train_state_dir(shared.checkpoints_dir, 7) == root / "checkpoints" / "step_7" / "trainer_state"
    assert latest_path(shared.checkpoints_dir) == root / "checkpoints" / "latest"


def test_steps_on_disk_are_the_finished_ones_in_numeric_order(shared: SharedDir) -> None:
    assert written_steps(shared.rollouts_dir) == [] and checkpoint_steps(shared.checkpoints_dir) == []
    shared.rollouts_dir.mkdir(parents=True)
    for name in ("step_10.msgpack", "step_2.msgpack", "step_3.msgpack.tmp1234", "step_x.msgpack", "notes"):
        (shared.rollouts_dir / name).write_bytes(b"")
    assert written_steps(shared.rollouts_dir) == [2, 10]
    for step in (10, 2):
        publish(shared, step)
    staging_dir(shared.checkpoints_dir, 11).mkdir()  # being written: not a checkpoint yet
    (shared.checkpoints_dir / "step_12").write_text("a file, not a checkpoint")
    assert checkpoint_steps(shared.checkpoints_dir) == [2, 10]


def test_latest_step_is_zero_before_the_first_checkpoint_and_refuses_garbage(shared: SharedDir) -> None:
    assert latest_step(shared.checkpoints_dir) == 0
    publish(shared, 3)
    assert latest_step(shared.checkpoints_dir) == 3
    latest_path(shared.checkpoints_dir).write_text("step three")
    with pytest.raises(ValueError, match="should hold a step number"):
        latest_step(shared.checkpoints_dir)


def test_a_run_is_there_once_it_wrote_a_batch_or_published_a_checkpoint(tmp_path: Path) -> None:
    empty, batched, published, staged = (SharedDir(tmp_path / name) for name in ("e", "b", "p", "s"))
    batched.rollouts_dir.mkdir(parents=True)
    batch_path(batched.rollouts_dir, 1).write_bytes(b"")
    publish(published, 1)
    staging_dir(staged.checkpoints_dir, 1).mkdir(parents=True)  # a crash before publishing
    assert [d.holds_a_run() for d in (empty, batched, published, staged)] == [False, True, True, False]


def test_waiting_for_a_batch_returns_once_it_lands(shared: SharedDir) -> None:
    shared.rollouts_dir.mkdir(parents=True)
    # Published as the orchestrator publishes batches (write_batch): whole or not at all. A plain
    # write_bytes creates the file before its bytes, and the waiter may read it empty in between.
    writer = threading.Timer(0.1, write_atomically, args=(batch_path(shared.rollouts_dir, 2), b"batch"))
    writer.start()
    try:
        path = wait_for_batch_file(shared.rollouts_dir, 2, timeout_s=30, poll_s=0.01)
    finally:
        writer.cancel()
    assert path.read_bytes() == b"batch"


@pytest.mark.parametrize("timeout_s", [0.0, 0.2])
def test_waiting_for_a_batch_gives_up_at_its_deadline(shared: SharedDir, timeout_s: float) -> None:
    started = time.monotonic()
    with pytest.raises(BatchTimeout, match="no rollout batch for step 2"):
        wait_for_batch_file(shared.rollouts_dir, 2, timeout_s=timeout_s, poll_s=0.01)
    assert timeout_s <= time.monotonic() - started < timeout_s + 5


async def test_waiting_for_a_checkpoint_returns_the_latest_once_it_is_new_enough(
    shared: SharedDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish(shared, 1)
    saw_step_1 = asyncio.Event()
    read_latest = shared_dir.latest_step

    def latest_step(checkpoints_dir: Path) -> int:
        step = read_latest(checkpoints_dir)
        if step == 1:
            saw_step_1.set()
        return step

    monkeypatch.setattr(shared_dir, "latest_step", latest_step)  # as the waiter reads it, unchanged
    waiting = asyncio.create_task(wait_for_checkpoint(shared.checkpoints_dir, 2, timeout_s=30, poll_s=0.01))
    await asyncio.wait_for(saw_step_1.wait(), timeout=30)
    assert not waiting.done()  # step 1 is not enough: it waits on
    monkeypatch.undo()
    publish(shared, 3)
    assert await asyncio.wait_for(waiting, timeout=30) == 3
    assert await wait_for_checkpoint(shared.checkpoints_dir, 0, timeout_s=0, poll_s=0.01) == 3


@pytest.mark.parametrize("timeout_s", [0.0, 0.2])
async def test_waiting_for_a_checkpoint_gives_up_at_its_deadline(shared: SharedDir, timeout_s: float) -> None:
    publish(shared, 1)
    started = time.monotonic()
    with pytest.raises(CheckpointTimeout, match="no trainer checkpoint for step 2"):
        await wait_for_checkpoint(shared.checkpoints_dir, 2, timeout_s=timeout_s, poll_s=0.01)
    assert timeout_s <= time.monotonic() - started < timeout_s + 5
