"""Pack samples into micro-batches: one image family per micro-batch, text-only samples fill any gap.

A packed micro-batch is the concatenation of whole samples. Each image's placeholder offset is
rebased by its sample's start in the packed stream, and the sample boundaries (`seq_lens`) travel
with it so the forward pass can keep samples from attending to each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from rawmm.rl.samples import MMImageRef, Sample, SampleError


@dataclass(frozen=True)
class PackedMicroBatch:
    """Whole samples laid end to end. `images[i]` belongs to `samples[image_sample[i]]`."""

    family: str | None
    samples: tuple[Sample, ...]
    seq_lens: tuple[int, ...]
    token_ids: list[int]
    mm_token_type_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    logprobs: list[float]
    images: tuple[MMImageRef, ...]
    image_sample: tuple[int, ...]

    @property
    def starts(self) -> tuple[int, ...]:
        """Start of each sample in the packed stream."""
        return (0, *accumulate(self.seq_lens[:-1]))

    def __len__(self) -> int:
        return len(self.token_ids)


def concat_samples(samples: list[Sample]) -> PackedMicroBatch:
    """Lay `samples` (of one family, or text-only) end to end, rebasing image offsets."""
    families = {s.family for s in samples if s.family is not None}
    if len(families) > 1:
        raise SampleError(f"cannot pack image families {sorted(families)} into one micro-batch")
    token_ids: list[int] = []
    mm_token_type_ids: list[int] = []
    loss_mask: list[bool] = []
    advantages: list[float] = []
    logprobs: list[float] = []
    images: list[MMImageRef] = []
    image_sample: list[int] = []
    for index, sample in enumerate(samples):
        start = len(token_ids)
        images.extend(image.shifted(start) for image in sample.mm_refs)
        image_sample.extend([index] * len(sample.mm_refs))
        token_ids.extend(sample.token_ids)
        mm_token_type_ids.extend(sample.mm_token_type_ids)
        loss_mask.extend(sample.loss_mask)
        advantages.extend(sample.advantages)
        logprobs.extend(sample.logprobs)
    return PackedMicroBatch(
        family=next(iter(families), None),
        samples=tuple(samples),
        seq_lens=tuple(len(s) for s in samples),
        token_ids=token_ids,
        mm_token_type_ids=mm_token_type_ids,
        loss_mask=loss_mask,
        advantages=advantages,
        logprobs=logprobs,
        images=tuple(images),
        image_sample=tuple(image_sample),
    )


def pack_samples(samples: list[Sample], max_tokens: int) -> list[PackedMicroBatch]:
    """First-fit-decreasing packing into micro-batches of at most `max_tokens` tokens.

    Image samples are binned per family (families never share a micro-batch); text-only samples
    then fill the remaining room of any bin, and open text-only bins when none has room. The result
    depends only on the samples, so every data-parallel rank computes the same micro-batches.
    """
    if max_tokens <= 0:
        raise SampleError(f"max_tokens must be positive, got {max_tokens}")
    for sample in samples:
        if len(sample) > max_tokens:
            raise SampleError(
                f"sample {sample.sample_id!r} has {len(sample)} tokens, more than a micro-batch's "
                f"{max_tokens}; truncate samples to seq_len <= micro_batch_tokens first"
            )
    # Longest first, ties in input order: stable and deterministic.
    ordered = sorted(samples, key=len, reverse=True)
    bins: list[list[Sample]] = []
    bin_family: list[str | None] = []
    room: list[int] = []

    def place(sample: Sample, candidates: list[int]) -> None:
        for b in candidates:
            if room[b] >= len(sample):
                bins[b].append(sample)
                room[b] -= len(sample)
                return
        bins.append([sample])
        bin_family.append(sample.family)
        room.append(max_tokens - len(sample))

    for sample in ordered:
        if sample.family is not None:
            place(sample, [b for b, family in enumerate(bin_family) if family == sample.family])
    for sample in ordered:
        if sample.family is None:
            place(sample, list(range(len(bins))))
    return [concat_samples(b) for b in bins]
