"""Turn the raw image refs of a packed micro-batch into the model's image tensors, on the trainer.

Each image is read through the confined, hash-verified path (`rawmm.materialize.read_ref_image`)
and processed by the family adapter with the run's processor identity — the same code and backend
the engines use, so the trainer trains on the pixels the engines sampled from. Within one step an
image is materialized once however many samples carry it (a group's prompt image, earlier turns).
The distinct images of a micro-batch are read and processed on a few threads (`workers`): decoding,
the hash check and the resize release the GIL, and the step waits for them before its first forward.

Images are held as uint8 patches (the resized pixels before rescale and normalize: a quarter of
float32) for the whole step; `normalizer` turns them into the processor's exact normalized pixels
where they are used, on the trainer's device, right before the forward pass (`forward_logprobs`).

A missing or unreadable image follows `missing_image_policy`:
- `error`: raise `MissingImageError` naming the step, the samples and the URIs;
- `zero_loss`: the image gets stand-in pixels of the right shape (so the packed forward still lines
  up) and *its sample's* loss mask and advantages are zeroed; the other samples of the micro-batch
  are untouched (block-diagonal attention keeps them independent of the stand-in).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import get_args

import numpy as np
import torch

from rawmm.config import MissingImagePolicy
from rawmm.contract import InvalidImageRef, RawImageDescriptor
from rawmm.materialize import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ForwardPolicy,
    LoadedProcessor,
    get_adapter,
    metrics,
    read_ref_image,
)
from rawmm.materialize.normalize import PixelNormalizer
from rawmm.materialize.read import RgbPixels
from rawmm.rl.samples import MMImageRef
from rawmm.rl.trainer.packing import PackedMicroBatch

# Reasons that mean "this image's bytes are gone or damaged": the policy decides. Every other reason
# (wrong root, fingerprint or grid mismatch, malformed ref) is a run misconfiguration and always raises.
UNAVAILABLE_REASONS = frozenset({"missing_file", "unreadable_file", "decode_error", "hash_mismatch"})


class MissingImageError(RuntimeError):
    """An image of a training step could not be loaded and the policy is `error`."""


@dataclass(frozen=True)
class MissingImage:
    sample_id: str
    uri: str
    reason: str
    message: str


@dataclass(frozen=True)
class MaterializedMicroBatch:
    """A micro-batch ready for the forward pass.

    `batch` is the input micro-batch with the loss mask and advantages of every sample in `missing`
    zeroed. `images` are each image's inputs (uint8 pixels) in packed image order; with dedupe, repeats
    share the step's one copy, so a step holds each unique image once until `mm_kwargs()` assembles the
    (still uint8) image inputs of this micro-batch right before its forward pass.
    """

    batch: PackedMicroBatch
    images: tuple[dict[str, torch.Tensor], ...]
    missing: tuple[MissingImage, ...]

    def mm_kwargs(self) -> dict[str, torch.Tensor]:
        """The model's image kwargs: per-image tensors concatenated along dim 0 (patch rows, grid rows)."""
        return _concat(self.images)

    def unique_mm_kwargs(self) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
        """The image kwargs of each distinct image of the micro-batch once (first use order), and for
        every placeholder span, in packed order, the index of its image among them: the forward then
        encodes each image once and scatters its embeddings to all of its spans. Images are the same
        when they are the same materialized inputs (the step's dedupe hands out one copy per image)."""
        first: dict[int, int] = {}
        index = tuple(first.setdefault(id(inputs), len(first)) for inputs in self.images)
        distinct = list({id(inputs): inputs for inputs in self.images}.values())
        return _concat(distinct), index


def _concat(images: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    if not images:
        return {}
    return {key: torch.cat([inputs[key] for inputs in images], dim=0) for key in images[0]}


@dataclass
class StepStats:
    """What one step's materialization did; the trainer sums it over ranks and exports it."""

    images: int = 0  # images referenced by the step's micro-batches
    materialized: int = 0  # images actually read and processed (the rest were deduplicated)
    missing: int = 0
    seconds: float = 0.0
    held_bytes: int = 0  # bytes of the image inputs the step holds (each materialized image once)


Loaded = tuple[dict[str, torch.Tensor], float]  # an image's uint8 inputs and the seconds they took


def _dedupe_key(image: MMImageRef) -> str:
    # The hash names the bytes; the descriptor names the layout they are processed to.
    return image.mm_hash + json.dumps(image.descriptor, sort_keys=True, separators=(",", ":"))


class RawImageMaterializer:
    """Materializes packed micro-batches for one model family, deduplicating within each step."""

    def __init__(
        self,
        processor: LoadedProcessor,
        *,
        roots: Sequence[Path],
        missing_image_policy: MissingImagePolicy,
        dedupe: bool = True,
        max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        workers: int = min(8, os.cpu_count() or 1),
    ) -> None:
        if missing_image_policy not in get_args(MissingImagePolicy):
            raise ValueError(
                f"missing_image_policy must be one of {get_args(MissingImagePolicy)}, got {missing_image_policy!r}"
            )
        self.processor = processor
        self.adapter = get_adapter(processor.family.name)
        self.roots = [Path(root).resolve() for root in roots]
        self.max_pixels = max_pixels
        self.policy = missing_image_policy
        self.dedupe = dedupe
        self.workers = workers
        self.step = 0
        self.stats = StepStats()
        self.normalizer = PixelNormalizer(processor)
        self._done: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def forward_policy(self) -> ForwardPolicy:
        return self.adapter.forward_policy

    def begin_step(self, step: int) -> None:
        """Start a new step: forget the previous step's images (dedupe is per step) and stats."""
        self.step = step
        self.stats = StepStats()
        self._done.clear()

    def materialize(self, batch: PackedMicroBatch) -> MaterializedMicroBatch:
        if batch.family is not None and batch.family != self.processor.family.name:
            raise ValueError(
                f"step {self.step}: micro-batch of family {batch.family!r} reached the "
                f"{self.processor.family.name!r} materializer"
            )
        started = time.perf_counter()
        per_image: list[dict[str, torch.Tensor]] = []
        missing: list[tuple[int, MissingImage]] = []
        ready = self._read_in_parallel(batch.images)
        for image, sample_index in zip(batch.images, batch.image_sample, strict=True):
            self.stats.images += 1
            try:
                per_image.append(self._image_inputs(image, ready))
            except InvalidImageRef as exc:
                if exc.reason not in UNAVAILABLE_REASONS:
                    raise
                sample_id = batch.samples[sample_index].sample_id
                missing.append((sample_index, MissingImage(sample_id, image.uri, exc.reason, exc.message)))
                per_image.append(self._stand_in_inputs(image))
        self.stats.seconds += time.perf_counter() - started
        if missing:
            self._handle_missing([m for _, m in missing])
            batch = _zero_samples(batch, {index for index, _ in missing})
        return MaterializedMicroBatch(
            batch=batch, images=tuple(per_image), missing=tuple(m for _, m in missing)
        )

    def _read_in_parallel(self, images: Sequence[MMImageRef]) -> dict[str, Loaded | InvalidImageRef]:
        """The micro-batch's distinct images not materialized yet this step, each read and processed on
        one of `workers` threads; an unavailable image's error is kept for the in-order loop, which
        handles it as it would have raised it. Empty (the loop does it all) for fewer than two images,
        one worker, or no dedupe."""
        todo: dict[str, MMImageRef] = {}
        for image in images:
            key = _dedupe_key(image)
            if key not in self._done:
                todo.setdefault(key, image)
        if not self.dedupe or self.workers < 2 or len(todo) < 2:
            return {}
        with ThreadPoolExecutor(min(self.workers, len(todo)), thread_name_prefix="materialize") as pool:
            return dict(zip(todo, pool.map(self._load_or_error, todo.values()), strict=True))

    def _load_or_error(self, image: MMImageRef) -> Loaded | InvalidImageRef:
        try:
            return self._load(image)
        except InvalidImageRef as exc:
            return exc

    def _load(self, image: MMImageRef) -> Loaded:
        started = time.perf_counter()
        descriptor = RawImageDescriptor.from_dict(image.descriptor)
        pixels = read_ref_image(
            descriptor, mm_hash=image.mm_hash, roots=self.roots, max_pixels=self.max_pixels
        )
        return self._uint8_inputs([pixels], [descriptor]), time.perf_counter() - started

    def _image_inputs(
        self, image: MMImageRef, ready: dict[str, Loaded | InvalidImageRef]
    ) -> dict[str, torch.Tensor]:
        key = _dedupe_key(image)
        if self.dedupe and key in self._done:
            return self._done[key]
        loaded = ready.pop(key, None) or self._load(image)
        if isinstance(loaded, InvalidImageRef):
            raise loaded
        inputs, seconds = loaded
        metrics.MATERIALIZE_SECONDS.labels(side="trainer").observe(seconds)
        self.stats.materialized += 1
        self.stats.held_bytes += sum(t.nbytes for t in inputs.values())
        if self.dedupe:
            self._done[key] = inputs
        return inputs

    def _stand_in_inputs(self, image: MMImageRef) -> dict[str, torch.Tensor]:
        """Inputs of a black image whose layout matches the descriptor's grid (checked by the adapter)."""
        descriptor = RawImageDescriptor.from_dict(image.descriptor)
        _, grid_h, grid_w = self.processor.family.grid_from_payload(descriptor.payload)
        patch = self.processor.config.patch_size
        stand_in = np.zeros((grid_h * patch, grid_w * patch, 3), np.uint8)
        return self._uint8_inputs([stand_in], [descriptor])

    def _uint8_inputs(
        self, images: Sequence[RgbPixels], descriptors: Sequence[RawImageDescriptor]
    ) -> dict[str, torch.Tensor]:
        # Held as uint8 patches (a quarter of float32) until the forward normalizes them on its device.
        return self.adapter.materialize_for_trainer(
            images, descriptors, self.processor, normalize=False
        ).kwargs

    def _handle_missing(self, missing: list[MissingImage]) -> None:
        if self.policy == "error":
            listed = "; ".join(f"sample {m.sample_id!r}: {m.uri} ({m.reason}: {m.message})" for m in missing)
            raise MissingImageError(
                f"step {self.step}: {len(missing)} image(s) could not be loaded "
                f"(missing_image_policy=error): {listed}"
            )
        self.stats.missing += len(missing)


def _zero_samples(batch: PackedMicroBatch, sample_indices: set[int]) -> PackedMicroBatch:
    loss_mask = list(batch.loss_mask)
    advantages = list(batch.advantages)
    for index in sample_indices:
        start = batch.starts[index]
        end = start + batch.seq_lens[index]
        loss_mask[start:end] = [False] * (end - start)
        advantages[start:end] = [0.0] * (end - start)
    return replace(batch, loss_mask=loss_mask, advantages=advantages)
