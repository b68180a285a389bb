"""Family adapters: decoded images -> model inputs, checked against what each descriptor claims.

The same adapter serves the engine (one image -> one ``EngineItem`` under the engine modality) and
the trainer (a batch -> the model's kwargs), so both sides run the same processor code on the same
bytes. Every disagreement between a descriptor and the processor is a client error with a reason:
another family or modality, another processor fingerprint, another grid, another placeholder length.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from PIL import Image

from rawmm.contract import InvalidImageRef, RawImageDescriptor, get_family
from rawmm.contract.families import Family
from rawmm.materialize.items import EngineItem, FieldKind, ForwardPolicy, TrainerInputs
from rawmm.materialize.processor import LoadedProcessor


class FamilyAdapter(ABC):
    """Materialization for one model family. Stateless; one shared instance per family."""

    family_name: ClassVar[str]
    grid_key: ClassVar[str]  # the model kwarg holding the per-image grids
    forward_policy: ClassVar[ForwardPolicy]

    @property
    def family(self) -> Family[Any]:
        return get_family(self.family_name)

    @abstractmethod
    def _process(
        self, processor: Any, images: Sequence[Image.Image], *, normalize: bool = True
    ) -> dict[str, torch.Tensor]:
        """Run the image processor: ``pixel_values`` (one row per patch) and ``grid_key`` (one row per image).

        ``normalize=False``: the resized pixels as ``uint8``, in the same patch layout (rescale and normalize
        left to the model's device)."""

    def check_descriptor(self, descriptor: RawImageDescriptor, processor: LoadedProcessor) -> None:
        """The checks that need no pixels: family, modality and fingerprint (cheap, so done before any read)."""
        if descriptor.family != self.family_name or processor.family.name != self.family_name:
            raise InvalidImageRef(
                "unknown_family",
                f"a {descriptor.family} image cannot be materialized with a {processor.family.name} processor",
            )
        if descriptor.modality != self.family.modality:
            raise InvalidImageRef(
                "modality_mismatch",
                f"{self.family_name} materializes {self.family.modality!r}, not {descriptor.modality!r}",
            )
        if descriptor.fingerprint is not None and descriptor.fingerprint != processor.fingerprint:
            raise InvalidImageRef(
                "fingerprint_mismatch",
                f"ref was rendered for processor {descriptor.fingerprint}, this side runs {processor.fingerprint} "
                f"({processor.backend} backend)",
            )

    def _check_grids(self, grids: torch.Tensor, descriptors: Sequence[RawImageDescriptor]) -> None:
        for index, (grid, descriptor) in enumerate(zip(grids.tolist(), descriptors, strict=True)):
            claimed = self.family.grid_from_payload(descriptor.payload)
            if tuple(grid) != claimed:
                raise InvalidImageRef(
                    "grid_mismatch",
                    f"image {index}: the processor gives grid {tuple(grid)}, the ref claims {claimed}",
                )

    def materialize_for_engine(
        self,
        image: Image.Image,
        descriptor: RawImageDescriptor,
        processor: LoadedProcessor,
        expected_placeholder_length: int,
    ) -> EngineItem:
        """One image as an engine item, its grid and placeholder length checked."""
        self.check_descriptor(descriptor, processor)
        try:
            layout = self.family.describe(width=image.width, height=image.height, config=processor.config)
        except ValueError as exc:  # e.g. Qwen's aspect-ratio limit of 200 (a 3x1000 strip)
            raise InvalidImageRef(
                "image_too_large",
                f"a {image.width}x{image.height} image has no {self.family_name} layout: {exc}",
            ) from None
        if layout.num_placeholder_tokens != expected_placeholder_length:
            raise InvalidImageRef(
                "placeholder_mismatch",
                f"a {image.width}x{image.height} image takes {layout.num_placeholder_tokens} placeholder tokens, "
                f"the request gives it {expected_placeholder_length}",
            )
        outputs = self._process(processor.processor, [image], normalize=processor.pixels == "normalized")
        self._check_grids(outputs[self.grid_key], [descriptor])
        return EngineItem(
            modality=self.family.engine_modality,
            tensors={"pixel_values": outputs["pixel_values"], self.grid_key: outputs[self.grid_key][0]},
            kinds={"pixel_values": FieldKind.FLAT, self.grid_key: FieldKind.BATCHED},
        )

    def materialize_for_trainer(
        self,
        images: Sequence[Image.Image],
        descriptors: Sequence[RawImageDescriptor],
        processor: LoadedProcessor,
    ) -> TrainerInputs:
        """A batch of images (prompt order) as the model's kwargs, each image's grid checked."""
        if len(images) != len(descriptors):
            raise InvalidImageRef(
                "count_mismatch", f"{len(images)} images for {len(descriptors)} descriptors"
            )
        for descriptor in descriptors:
            self.check_descriptor(descriptor, processor)
        outputs = self._process(processor.processor, images)
        self._check_grids(outputs[self.grid_key], descriptors)
        return TrainerInputs(kwargs=outputs, forward_policy=self.forward_policy)


class QwenVLAdapter(FamilyAdapter):
    family_name = "qwen_vl"
    grid_key = "image_grid_thw"
    # Qwen builds its M-RoPE positions itself from the grids and the token types.
    forward_policy = ForwardPolicy(pass_position_ids=False, requires_mm_token_type_ids=True)

    def _process(
        self, processor: Any, images: Sequence[Image.Image], *, normalize: bool = True
    ) -> dict[str, torch.Tensor]:
        if normalize:
            out = processor(images=list(images), return_tensors="pt")
            return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        out = processor(images=list(images), return_tensors="pt", do_rescale=False, do_normalize=False)
        # The torchvision backend keeps uint8; the PIL backend returns the same whole values as float32.
        return {"pixel_values": out["pixel_values"].to(torch.uint8), "image_grid_thw": out["image_grid_thw"]}


class KimiK25Adapter(FamilyAdapter):
    family_name = "kimi_k25"
    grid_key = "grid_thws"
    forward_policy = ForwardPolicy(pass_position_ids=True, requires_mm_token_type_ids=False)

    def _process(
        self, processor: Any, images: Sequence[Image.Image], *, normalize: bool = True
    ) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = processor(images, normalize=normalize)
        return tensors


_ADAPTERS: dict[str, FamilyAdapter] = {
    adapter.family_name: adapter for adapter in (QwenVLAdapter(), KimiK25Adapter())
}


def get_adapter(family: str) -> FamilyAdapter:
    """The adapter of ``family``; an unknown family is ``InvalidImageRef("unknown_family")``."""
    adapter = _ADAPTERS.get(family) if isinstance(family, str) else None
    if adapter is None:
        raise InvalidImageRef(
            "unknown_family", f"no materializer for family {family!r}; known: {sorted(_ADAPTERS)}"
        )
    return adapter
