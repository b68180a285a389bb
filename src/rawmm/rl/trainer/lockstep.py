"""Which forward/backward passes each rank runs in a step, so that FSDP ranks stay in lockstep.

FSDP all-gathers a unit before its forward and reduce-scatters its gradients after its backward, so
every rank must run the same number of passes through the same units in the same order. Data
parallelism deals micro-batches round-robin, which breaks that twice: ranks get unequal counts, and
a text-only micro-batch skips the vision tower that an image micro-batch on another rank runs.

So under FSDP each rank runs `ceil(micro-batches / world)` slots, and a slot whose micro-batch is
missing or, in a step that has images, has none, gets a *filler*: a copy of the step's shortest
sample (with images when the step has any) whose loss mask and advantages are zeroed, appended to
the micro-batch (or alone). It contributes nothing to the loss, the loss-token count or any
gradient, and block-diagonal attention keeps the real samples from seeing it. Its images are
stand-in pixels of the right shape, never read from disk, and count in no image statistic.
The micro-batches themselves are the ones `pack_samples` made, as under DDP; one with a filler is
longer than `micro_batch_tokens` by the filler's length (at most `seq_len`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import msgspec
import torch

from rawmm.rl.samples import MMImageRef, Sample
from rawmm.rl.trainer.materializer import MaterializedMicroBatch
from rawmm.rl.trainer.packing import PackedMicroBatch, concat_samples


@dataclass(frozen=True)
class Slot:
    """One forward/backward pass of a rank: a micro-batch of the step, a filler, or both."""

    batch: PackedMicroBatch | None
    filler: Sample | None


def zero_loss(sample: Sample) -> Sample:
    n = len(sample)
    return msgspec.structs.replace(sample, loss_mask=[False] * n, advantages=[0.0] * n)


def rank_slots(
    micro_batches: Sequence[PackedMicroBatch], rank: int, world_size: int, *, lockstep: bool
) -> list[Slot]:
    """Rank `rank`'s passes: micro-batches `rank, rank + world, ...`, plus fillers when `lockstep`."""
    mine = [Slot(batch, None) for batch in micro_batches[rank::world_size]]
    if not lockstep or not micro_batches:
        return mine
    samples = [s for batch in micro_batches for s in batch.samples]
    with_images = [s for s in samples if s.mm_refs]
    filler = zero_loss(min(with_images or samples, key=len))  # the first shortest: same on every rank
    slots = -(-len(micro_batches) // world_size)
    mine += [Slot(None, None)] * (slots - len(mine))
    return [
        slot
        if slot.batch is not None and (slot.batch.images or not with_images)
        else Slot(slot.batch, filler)
        for slot in mine
    ]


def append_filler(
    real: MaterializedMicroBatch | None,
    filler: Sample,
    stand_in: Callable[[MMImageRef], dict[str, torch.Tensor]],
) -> MaterializedMicroBatch:
    """`real` (already materialized, its missing-image zeroing kept) with `filler` laid after it."""
    head = real.batch if real is not None else None
    batch = concat_samples([*(head.samples if head else ()), filler])
    if head is not None:
        batch = replace(
            batch,
            loss_mask=[*head.loss_mask, *filler.loss_mask],
            advantages=[*head.advantages, *filler.advantages],
        )
    return MaterializedMicroBatch(
        batch=batch,
        images=(*(real.images if real else ()), *(stand_in(image) for image in filler.mm_refs)),
        missing=real.missing if real else (),
    )
