"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL: smart-resize layout, ``<|image_pad|>`` x N placeholders."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rawmm.contract.families.base import Family, Layout, check_size, parse_grid_list

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC


@dataclass(frozen=True)
class QwenVLConfig:
    """The Qwen image-processor values that decide the layout or the pixels."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    resample: int = BICUBIC
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@functools.cache
def _smart_resize() -> Callable[..., tuple[int, int]]:
    # The processor's own resize math, imported rather than ported so the layout cannot drift from it.
    # Imported lazily: it pulls in transformers' image stack, which `import rawmm.contract` should not.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize


def _channels(value: Any) -> tuple[float, ...]:
    if isinstance(value, int | float):
        return (float(value),) * 3
    return tuple(float(v) for v in value)


QwenVLPreset = Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


class QwenVLFamily(Family[QwenVLConfig]):
    name = "qwen_vl"
    placeholder_token = "<|image_pad|>"
    config_type = QwenVLConfig
    # Qwen2-VL, Qwen2.5-VL and Qwen3-VL (dense and MoE) share one image processor.
    model_types = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
    # transformers' AutoImageProcessor loads the torchvision processor, and vLLM's Qwen-VL path runs it.
    default_backend = "torchvision"
    preset_names = QwenVLPreset
    presets = {
        "qwen2_vl": QwenVLConfig(14, 2, 2, 3136, 12845056, CLIP_MEAN, CLIP_STD),
        "qwen2_5_vl": QwenVLConfig(14, 2, 2, 3136, 12845056, CLIP_MEAN, CLIP_STD),
        "qwen3_vl": QwenVLConfig(16, 2, 2, 65536, 16777216, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    }

    def config_from_pretrained(self, path: str | Path) -> QwenVLConfig:
        # Let transformers read the file: its precedence rules (min_pixels/max_pixels over size, class
        # defaults for absent keys) then hold here by construction.
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        if not Path(path).is_dir():
            raise FileNotFoundError(f"{path} is not a checkpoint directory")
        return self.config_from_processor(
            Qwen2VLImageProcessorPil.from_pretrained(str(path), local_files_only=True)
        )

    def config_from_processor(self, processor: Any) -> QwenVLConfig:
        image_processor = getattr(processor, "image_processor", processor)
        if not getattr(image_processor, "do_resize", True):
            raise ValueError("Qwen image processors with do_resize=False are not supported")
        size = image_processor.size
        return QwenVLConfig(
            patch_size=int(image_processor.patch_size),
            merge_size=int(image_processor.merge_size),
            temporal_patch_size=int(image_processor.temporal_patch_size),
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
            image_mean=_channels(image_processor.image_mean),
            image_std=_channels(image_processor.image_std),
            resample=int(image_processor.resample),
            rescale_factor=float(image_processor.rescale_factor),
            do_rescale=bool(image_processor.do_rescale),
            do_normalize=bool(image_processor.do_normalize),
            do_convert_rgb=bool(image_processor.do_convert_rgb),
        )

    def describe(self, *, width: int, height: int, config: QwenVLConfig) -> Layout:
        check_size(width, height)
        resized_h, resized_w = _smart_resize()(
            height, width, factor=config.factor, min_pixels=config.min_pixels, max_pixels=config.max_pixels
        )
        grid = (1, resized_h // config.patch_size, resized_w // config.patch_size)
        tokens = grid[0] * grid[1] * grid[2] // config.merge_size**2
        return Layout(
            grid_thw=grid,
            resized=(resized_h, resized_w),
            num_placeholder_tokens=tokens,
            num_vision_tokens=tokens,
        )

    def payload(self, layout: Layout) -> dict[str, Any]:
        return {"image_grid_thw": [list(layout.grid_thw)]}

    def grid_from_payload(self, payload: Any) -> tuple[int, int, int]:
        return parse_grid_list(payload, "image_grid_thw")
