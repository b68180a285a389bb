"""Family adapters: a checkpoint's image processor, and decoded images -> model inputs, checked against what
each descriptor claims.

The adapter is a family's one record on the materialize side (the contract's ``Family`` holds the layout
math): how its processor is loaded, which backend a loaded one runs, and how it is called. The same adapter serves the engine (one image -> one ``EngineItem`` under the engine modality) and
the trainer (a batch -> the model's kwargs), so both sides run the same processor code on the same
bytes. Every disagreement between a descriptor and the processor is a client error with a reason:
another family or modality, another processor fingerprint, another grid, another placeholder length.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from rawmm.contract import InvalidImageRef, RawImageDescriptor, get_family
from rawmm.contract.families import Family, checkpoint_file
from rawmm.materialize.items import EngineItem, FieldKind, ForwardPolicy, TrainerInputs
from rawmm.materialize.kimi import KimiK25ImageProcessor
from rawmm.materialize.kimi_checkpoint import publish
from rawmm.materialize.qwen_uint8 import uint8_patches
from rawmm.materialize.read import RgbPixels

if TYPE_CHECKING:  # processor.py loads processors through the adapters
    from rawmm.materialize.processor import LoadedProcessor


class FamilyAdapter(ABC):
    """Materialization for one model family. Stateless; one shared instance per family."""

    family_name: ClassVar[str]
    grid_key: ClassVar[str]  # the engine item's field holding the per-image grids (vLLM's processor's name)
    forward_policy: ClassVar[ForwardPolicy]
    # Item field -> transformers model kwarg, where the two names differ (Kimi's grid: vLLM's model takes
    # ``grid_thws``, transformers' ``image_grid_thw``). Items keep vLLM's names; the trainer and the
    # transformers engine rename here.
    model_kwarg_names: ClassVar[Mapping[str, str]] = MappingProxyType({})

    def model_kwargs(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Item fields (one image's or collated) as the transformers model's kwargs."""
        return {self.model_kwarg_names.get(key, key): value for key, value in tensors.items()}

    def publish_checkpoint(self, path: Path) -> None:
        """Make a checkpoint transformers' ``save_pretrained`` wrote into the published format every engine
        loads (in place). Qwen-VL's already is."""
        return None

    @property
    def family(self) -> Family[Any]:
        return get_family(self.family_name)

    @abstractmethod
    def load_image_processor(self, path: str, backend: str, trust_remote_code: bool) -> Any:
        """The image processor of checkpoint ``path`` (a local dir or a hub id) on ``backend``."""

    def backend_of(self, processor: Any) -> str:
        """The backend a loaded image processor really uses; transformers' processors tell by their class."""
        from transformers.image_processing_backends import PilBackend, TorchvisionBackend

        if isinstance(processor, PilBackend):
            return "pil"
        if isinstance(processor, TorchvisionBackend):
            return "torchvision"
        raise ValueError(f"{type(processor).__name__} is neither a PIL nor a torchvision image processor")

    def normalization_table(self, processor: Any) -> torch.Tensor:
        """``(channels, 256)`` float32: ``table[c, v]`` is what ``processor`` makes of uint8 value ``v`` in
        channel ``c``, computed by the processor's *own* ops on the 256 values, so its op order holds by
        construction: the torchvision backend's fused ``(x - 255·mean) / (255·std)``, the PIL backend's
        float64 rescale then float32 normalize, each only when enabled."""
        channels = len(processor.image_mean)
        values = np.tile(np.arange(256, dtype=np.uint8), (channels, 1))[:, None, :]  # a (C, 1, 256) image
        mean, std = tuple(processor.image_mean), tuple(processor.image_std)
        if self.backend_of(processor) == "torchvision":
            flags = processor.do_rescale, processor.rescale_factor, processor.do_normalize
            out = processor.rescale_and_normalize(torch.from_numpy(values)[None], *flags, mean, std)[0]
        else:
            out = values
            if processor.do_rescale:
                out = processor.rescale(out, processor.rescale_factor)
            if processor.do_normalize:
                out = processor.normalize(out, mean, std)
        return torch.as_tensor(np.asarray(out, dtype=np.float32)).reshape(channels, 256).contiguous()

    @abstractmethod
    def _process(
        self, processor: Any, images: Sequence[RgbPixels], *, normalize: bool = True
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
        image: RgbPixels,
        descriptor: RawImageDescriptor,
        processor: LoadedProcessor,
        expected_placeholder_length: int,
    ) -> EngineItem:
        """One image as an engine item, its grid and placeholder length checked."""
        self.check_descriptor(descriptor, processor)
        height, width = image.shape[:2]
        try:
            layout = self.family.describe(width=width, height=height, config=processor.config)
        except ValueError as exc:  # e.g. Qwen's aspect-ratio limit of 200 (a 3x1000 strip)
            raise InvalidImageRef(
                "image_too_large",
                f"a {width}x{height} image has no {self.family_name} layout: {exc}",
            ) from None
        if layout.num_placeholder_tokens != expected_placeholder_length:
            raise InvalidImageRef(
                "placeholder_mismatch",
                f"a {width}x{height} image takes {layout.num_placeholder_tokens} placeholder tokens, "
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
        images: Sequence[RgbPixels],
        descriptors: Sequence[RawImageDescriptor],
        processor: LoadedProcessor,
        *,
        normalize: bool = True,
    ) -> TrainerInputs:
        """A batch of images (prompt order) as the transformers model's kwargs, each image's grid checked.

        ``normalize=False``: ``pixel_values`` stay the uint8 patches, for ``PixelNormalizer`` where they are used."""
        if len(images) != len(descriptors):
            raise InvalidImageRef(
                "count_mismatch", f"{len(images)} images for {len(descriptors)} descriptors"
            )
        for descriptor in descriptors:
            self.check_descriptor(descriptor, processor)
        outputs = self._process(processor.processor, images, normalize=normalize)
        self._check_grids(outputs[self.grid_key], descriptors)
        return TrainerInputs(kwargs=self.model_kwargs(outputs), forward_policy=self.forward_policy)


class QwenVLAdapter(FamilyAdapter):
    family_name = "qwen_vl"
    grid_key = "image_grid_thw"
    # Qwen builds its M-RoPE positions itself from the grids and the token types.
    forward_policy = ForwardPolicy(pass_position_ids=False, requires_mm_token_type_ids=True)

    def load_image_processor(self, path: str, backend: str, trust_remote_code: bool) -> Any:
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(path, backend=backend, trust_remote_code=trust_remote_code)

    def _process(
        self, processor: Any, images: Sequence[RgbPixels], *, normalize: bool = True
    ) -> dict[str, torch.Tensor]:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

        if normalize:
            out = processor(images=list(images), return_tensors="pt", input_data_format="channels_last")
            return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        # Exactly the class whose output uint8_patches reproduces (a subclass may lay patches out otherwise).
        if type(processor) is Qwen2VLImageProcessor:
            return uint8_patches(processor, images)
        out = processor(
            images=list(images),
            return_tensors="pt",
            input_data_format="channels_last",
            do_rescale=False,
            do_normalize=False,
        )
        # The PIL backend returns the resized whole values as float32.
        return {"pixel_values": out["pixel_values"].to(torch.uint8), "image_grid_thw": out["image_grid_thw"]}


class KimiK25Adapter(FamilyAdapter):
    family_name = "kimi_k25"
    grid_key = "grid_thws"
    forward_policy = ForwardPolicy(pass_position_ids=True, requires_mm_token_type_ids=False)
    model_kwarg_names = MappingProxyType({"grid_thws": "image_grid_thw"})  # Kimi_K25ForConditionalGeneration

    def publish_checkpoint(self, path: Path) -> None:
        publish(path)  # transformers 5.19 saves three names and the architecture off the published format

    def load_image_processor(self, path: str, backend: str, trust_remote_code: bool) -> Any:
        # Our own implementation of the published preprocessing: no remote code runs.
        preprocessor_file = checkpoint_file(path, "preprocessor_config.json")
        if preprocessor_file is None:
            raise ValueError(f"{path} has no preprocessor_config.json")
        return KimiK25ImageProcessor(self.family.config_from_pretrained(preprocessor_file), backend)

    def backend_of(self, processor: Any) -> str:
        if not isinstance(processor, KimiK25ImageProcessor):
            raise ValueError(f"{type(processor).__name__} is not rawmm's Kimi K2.5 image processor")
        return processor.backend

    def normalization_table(self, processor: Any) -> torch.Tensor:
        table: torch.Tensor = processor.normalization_table()
        return table

    def _process(
        self, processor: Any, images: Sequence[RgbPixels], *, normalize: bool = True
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
