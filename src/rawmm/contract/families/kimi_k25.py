"""Kimi K2.5: navit resize bounded by patch limits, padded to patch*merge, one ``<|media_pad|>`` per vision token.

The math follows the published K2.5 media processor (``media_proc_cfg`` in the checkpoint's preprocessor
config), which vLLM 0.32 runs, and transformers' own ``Kimi_K25ImageProcessor`` (tests hold all three
equal). The chat template writes one ``<|media_pad|>`` per image; every processor then expands it to one
token per vision embedding (grid patches / merge²) before the model sees the prompt: the published and
vLLM's ``KimiK25Processor``, transformers' ``Kimi_K25Processor``. The prompt a rawmm ref belongs to is
that expanded one, as for Qwen, so the trainer and the transformers engine forward exactly the tokens
vLLM runs, and positions after an image are the same everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rawmm.contract.families.base import Family, Layout, check_size, parse_grid_list, read_preprocessor_config


@dataclass(frozen=True)
class KimiK25Config:
    """The ``media_proc_cfg`` values that decide the layout or the pixels."""

    patch_size: int = 14
    merge_size: int = 2
    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)


def _merge_size(value: Any) -> int:
    if isinstance(value, list | tuple):
        if len(set(value)) != 1:
            raise ValueError(f"non-square merge_kernel_size {value} is not supported")
        value = value[0]
    return int(value)


KimiK25Preset = Literal["kimi_k25"]


class KimiK25Family(Family[KimiK25Config]):
    name = "kimi_k25"
    vllm_modality = "vision_chunk"
    placeholder_token = "<|media_pad|>"
    config_type = KimiK25Config
    model_types = ("kimi_k25",)
    # Kimi checkpoints with remote code may name another model_type; their processor config says Kimi.
    preprocessor_markers = ("media_proc_cfg",)
    # vLLM's Kimi-K2.5 path runs the published processor (its fused copy): PIL's bicubic resize.
    default_backend = "pil"
    preset_names = KimiK25Preset
    presets = {"kimi_k25": KimiK25Config()}

    def config_from_mapping(self, cfg: Mapping[str, Any]) -> KimiK25Config:
        """A config from a ``media_proc_cfg`` mapping; absent keys take the K2.5 defaults."""
        if cfg.get("fixed_output_tokens") is not None:
            raise ValueError("Kimi media_proc_cfg with fixed_output_tokens is not supported")
        default = KimiK25Config()
        return KimiK25Config(
            patch_size=int(cfg.get("patch_size", default.patch_size)),
            merge_size=_merge_size(cfg.get("merge_kernel_size", default.merge_size)),
            in_patch_limit=int(cfg.get("in_patch_limit", default.in_patch_limit)),
            patch_limit_on_one_side=int(cfg.get("patch_limit_on_one_side", default.patch_limit_on_one_side)),
            image_mean=tuple(float(v) for v in cfg.get("image_mean", default.image_mean)),
            image_std=tuple(float(v) for v in cfg.get("image_std", default.image_std)),
        )

    def config_from_pretrained(self, path: str | Path) -> KimiK25Config:
        data = read_preprocessor_config(path)
        return self.config_from_mapping(data.get("media_proc_cfg", data))

    def config_from_processor(self, processor: Any) -> KimiK25Config:
        media = getattr(processor, "media_processor", getattr(processor, "image_processor", processor))
        cfg = getattr(media, "media_proc_cfg", None)
        if not isinstance(cfg, Mapping):
            raise ValueError(f"{type(processor).__name__} has no media_proc_cfg; not a Kimi K2.5 processor")
        return self.config_from_mapping(cfg)

    def describe(self, *, width: int, height: int, config: KimiK25Config) -> Layout:
        check_size(width, height)
        patch = config.patch_size
        side_limit = config.patch_limit_on_one_side * patch
        # Same operations, in the same order, as the reference processor: float results must match bit for bit.
        scale = min(
            1.0,
            math.sqrt(config.in_patch_limit / (max(1.0, width // patch) * max(1.0, height // patch))),
            side_limit / width,
            side_limit / height,
        )
        new_w = min(max(1, int(width * scale)), side_limit)
        new_h = min(max(1, int(height * scale)), side_limit)
        factor = config.merge_size * patch
        padded_w = math.ceil(new_w / factor) * factor
        padded_h = math.ceil(new_h / factor) * factor
        grid = (1, padded_h // patch, padded_w // patch)
        tokens = grid[1] * grid[2] // config.merge_size**2
        return Layout(
            grid_thw=grid,
            resized=(new_h, new_w),
            num_placeholder_tokens=tokens,  # the expanded prompt's (see the module docstring)
            num_vision_tokens=tokens,
        )

    def payload(self, layout: Layout) -> dict[str, Any]:
        return {"grid_thws": [list(layout.grid_thw)]}

    def grid_from_payload(self, payload: Any) -> tuple[int, int, int]:
        return parse_grid_list(payload, "grid_thws")
