"""Which images a run's batches still need: everything newer than the last checkpoint, plus kept steps."""

from __future__ import annotations

import pytest
from retention_kit import aged_images, checkpoint, write_step

from rawmm.contract import OffloadStore
from rawmm.contract.shared_dir import SharedDir
from rawmm.materialize import LoadedProcessor
from rawmm.rl.retention.needed import needed_images
from rawmm.rl.samples import SampleError


@pytest.fixture
def five_steps(shared: SharedDir, store: OffloadStore, loaded: LoadedProcessor) -> dict[int, set[str]]:
    """Batches 1..5, two images each (step 5 shares one with step 4)."""
    images = aged_images(store, range(9))
    by_step = {step: images[2 * (step - 1) : 2 * step] for step in range(1, 5)}
    by_step[5] = [images[7], images[8]]
    for step, stored in by_step.items():
        write_step(shared, step, stored, loaded)
    return {step: {s.mm_hash for s in stored} for step, stored in by_step.items()}


def test_without_a_checkpoint_every_batch_is_needed(
    shared: SharedDir, five_steps: dict[int, set[str]]
) -> None:
    needed = needed_images(shared.path)
    assert needed.latest_step == 0 and needed.steps == (1, 2, 3, 4, 5)
    assert needed.mm_hashes == set().union(*five_steps.values())


def test_trained_steps_are_not_needed_unless_kept(shared: SharedDir, five_steps: dict[int, set[str]]) -> None:
    checkpoint(shared, 3)
    needed = needed_images(shared.path)
    assert needed.steps == (4, 5)
    assert needed.mm_hashes == five_steps[4] | five_steps[5]
    kept = needed_images(shared.path, keep_steps=2)
    assert kept.steps == (2, 3, 4, 5)
    assert kept.mm_hashes == five_steps[2] | five_steps[3] | five_steps[4] | five_steps[5]


def test_an_unreadable_batch_raises_instead_of_needing_nothing(
    shared: SharedDir, five_steps: dict[int, set[str]]
) -> None:
    (shared.rollouts_dir / "step_6.msgpack").write_bytes(b"\x93not a batch")
    with pytest.raises(SampleError):
        needed_images(shared.path)


def test_an_empty_shared_dir_needs_nothing(shared: SharedDir) -> None:
    needed = needed_images(shared.path)
    assert (needed.latest_step, needed.steps, needed.mm_hashes) == (0, (), frozenset())
