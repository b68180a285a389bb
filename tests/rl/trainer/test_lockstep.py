"""Lockstep slots: FSDP ranks run equal passes through the same units; fillers change nothing else."""

from __future__ import annotations

import pytest
import torch

from rawmm.rl.trainer.forward import forward_logprobs
from rawmm.rl.trainer.lockstep import append_filler, rank_slots
from rawmm.rl.trainer.materializer import RawImageMaterializer
from rawmm.rl.trainer.packing import pack_samples


@pytest.fixture
def step_samples(rollouts):
    """The standard batch plus three text-only samples: four image micro-batches and a text-only one."""
    extra = [rollouts.sample([], " hello there", 0.5, f"text-{i}") for i in range(3)]
    return rollouts.standard_batch() + extra


def test_without_lockstep_ranks_take_micro_batches_round_robin(step_samples):
    micro_batches = pack_samples(step_samples, 64)
    for world in (1, 2, 3):
        for rank in range(world):
            slots = rank_slots(micro_batches, rank, world, lockstep=False)
            assert [s.batch for s in slots] == micro_batches[rank::world]
            assert all(s.filler is None for s in slots)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_lockstep_gives_every_rank_equal_passes_through_the_vision_tower(step_samples, world):
    micro_batches = pack_samples(step_samples, 64)
    assert any(not mb.images for mb in micro_batches) and any(mb.images for mb in micro_batches)
    per_rank = [rank_slots(micro_batches, rank, world, lockstep=True) for rank in range(world)]
    assert len({len(slots) for slots in per_rank}) == 1
    # Every micro-batch is trained exactly once, by the rank DDP would give it.
    for rank, slots in enumerate(per_rank):
        assert [s.batch for s in slots if s.batch is not None] == micro_batches[rank::world]
    shortest = min((s for s in step_samples if s.mm_refs), key=len)
    for slot in (slot for slots in per_rank for slot in slots):
        if slot.batch is not None and slot.batch.images:
            assert slot.filler is None
        else:  # missing or text-only: the shortest image sample rides along, without loss
            filler = slot.filler
            assert filler is not None and filler.token_ids == shortest.token_ids and filler.mm_refs
            assert not any(filler.loss_mask) and not any(filler.advantages)


def test_a_text_only_step_gets_text_fillers_only_where_a_slot_is_empty(rollouts):
    samples = [rollouts.sample([], " hello there", 0.5, f"text-{i}") for i in range(3)]
    micro_batches = pack_samples(samples, len(samples[0]))
    assert len(micro_batches) == 3
    first, second = (rank_slots(micro_batches, rank, 2, lockstep=True) for rank in range(2))
    assert all(s.filler is None for s in first) and second[0].filler is None
    assert second[1].batch is None and second[1].filler.token_ids == samples[0].token_ids
    assert rank_slots([], 0, 2, lockstep=True) == []


def test_a_filler_leaves_the_real_samples_logprobs_and_loss_alone(rollouts, step_samples):
    config = rollouts.config
    materializer = RawImageMaterializer(
        rollouts.loaded, roots=[config.offload_dir], missing_image_policy="error"
    )
    micro_batches = pack_samples(step_samples, 64)
    [text_only] = [mb for mb in micro_batches if not mb.images]
    filler = rank_slots(micro_batches, 1, 2, lockstep=True)[-1].filler
    materializer.begin_step(1)
    real = materializer.materialize(text_only)
    stats = (materializer.stats.images, materializer.stats.materialized, materializer.stats.missing)
    rollouts.delete_image(filler.mm_refs[0].uri)  # a filler's pixels are stand-ins, never read
    padded = append_filler(real, filler, materializer._stand_in_inputs)
    assert (materializer.stats.images, materializer.stats.materialized, materializer.stats.missing) == stats
    n = len(text_only)
    assert padded.batch.loss_mask[:n] == real.batch.loss_mask and not any(padded.batch.loss_mask[n:])
    assert len(padded.images) == len(filler.mm_refs) and padded.missing == ()

    def logprobs(m):  # noqa: ANN001, ANN202
        with torch.no_grad():
            return forward_logprobs(
                rollouts.model,
                m.batch,
                m.mm_kwargs(),
                materializer.forward_policy,
                normalizer=materializer.normalizer,
            )

    torch.testing.assert_close(logprobs(padded)[:n], logprobs(real), rtol=0, atol=1e-5)
