"""Kimi K2.5 image preprocessing from the published math, so no remote code has to run.

Per image: navit resize (the family's layout math: bounded by ``in_patch_limit`` and
``patch_limit_on_one_side``) with bicubic resampling, zero-pad bottom/right to a multiple of
patch·merge, rescale to [0, 1] and normalize with mean/std (0.5 by default), then cut into
``patch × patch`` patches in row-major grid order: ``pixel_values`` is ``(patches, 3, patch, patch)``
and ``grid_thws`` is ``[[1, H/patch, W/patch]]`` per image.

Each backend reproduces one reference bit for bit (tests/materialize/test_kimi_parity.py):
- ``pil``: the published processor as vLLM 0.32 runs it (``KimiK25FusedVisionProcessor``): PIL bicubic,
  then ``(v / 255 - mean) * (1 / std)`` in float32;
- ``torchvision``: transformers' ``Kimi_K25ImageProcessor``: torchvision's antialiased bicubic on uint8,
  then its ``rescale_and_normalize``, which folds the rescale into mean and std. Its table is computed
  by that very method, so the op order holds by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from PIL import Image

from rawmm.contract.families import BACKENDS, KimiK25Config, get_family
from rawmm.materialize.read import RgbPixels


def _normalization_lut(config: KimiK25Config, backend: str) -> np.ndarray:
    """``(256, 3)`` float32: what the backend's reference makes of each uint8 value per channel."""
    values = np.arange(256, dtype=np.float32)[:, None]
    mean = np.asarray(config.image_mean, dtype=np.float32)
    std = np.asarray(config.image_std, dtype=np.float32)
    if backend == "pil":
        lut: np.ndarray = ((values / 255.0 - mean) * (1.0 / std)).astype(np.float32)
        return lut
    from transformers import Kimi_K25ImageProcessor

    # Its mean/std cache (lru_cache) needs tuples, which transformers' annotation does not list.
    reference: Any = Kimi_K25ImageProcessor(
        image_mean=list(config.image_mean), image_std=list(config.image_std)
    )
    image = torch.from_numpy(np.ascontiguousarray(np.broadcast_to(values.T, (3, 256))))[None, :, None, :]
    out = reference.rescale_and_normalize(
        image, True, reference.rescale_factor, True, tuple(config.image_mean), tuple(config.image_std)
    )
    return np.ascontiguousarray(out[0, :, 0, :].numpy().T, dtype=np.float32)


class KimiK25ImageProcessor:
    """Turns RGB images into Kimi K2.5's ``pixel_values`` and ``grid_thws``."""

    def __init__(self, config: KimiK25Config, backend: str = "pil") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown image-processor backend {backend!r}; expected one of {BACKENDS}")
        self.config = config
        self.backend = backend
        # Every uint8 value of every channel, normalized once: (256, 3).
        self._lut = _normalization_lut(config, backend)

    def normalization_table(self) -> torch.Tensor:
        """``(3, 256)`` float32: what normalizing makes of each uint8 value per channel (``PixelNormalizer``)."""
        return torch.from_numpy(np.ascontiguousarray(self._lut.T))

    @property
    def media_proc_cfg(self) -> dict[str, Any]:
        """The config in the checkpoint's ``media_proc_cfg`` vocabulary."""
        cfg = asdict(self.config)
        cfg["merge_kernel_size"] = cfg.pop("merge_size")
        return cfg

    def __call__(self, images: Sequence[RgbPixels], *, normalize: bool = True) -> dict[str, torch.Tensor]:
        """``normalize=False``: the padded, resized pixels as uint8 patches (the device normalizes them)."""
        patches, grids = [], []
        for image in images:
            image_patches, grid = self._process(image, normalize)
            patches.append(image_patches)
            grids.append(grid)
        patch = self.config.patch_size
        return {
            "pixel_values": torch.from_numpy(np.concatenate(patches))
            if patches
            else torch.empty(0, 3, patch, patch, dtype=torch.float32 if normalize else torch.uint8),
            "grid_thws": torch.tensor(grids, dtype=torch.int64).reshape(-1, 3),
        }

    def _process(self, image: RgbPixels, normalize: bool) -> tuple[np.ndarray, list[int]]:
        height, width = image.shape[:2]
        layout = get_family("kimi_k25").describe(width=width, height=height, config=self.config)
        new_h, new_w = layout.resized
        _, grid_h, grid_w = layout.grid_thw
        patch = self.config.patch_size
        canvas = np.zeros((grid_h * patch, grid_w * patch, 3), dtype=np.uint8)
        canvas[:new_h, :new_w] = self._resize(image, new_w, new_h)
        pixels = self._lut[canvas, np.arange(3)] if normalize else canvas  # (H, W, 3) float32 | uint8
        patches = (
            pixels.reshape(grid_h, patch, grid_w, patch, 3)
            .transpose(0, 2, 4, 1, 3)  # (gh, gw, C, ph, pw): patches in row-major grid order
            .reshape(grid_h * grid_w, 3, patch, patch)
        )
        return np.ascontiguousarray(patches), [1, grid_h, grid_w]

    def _resize(self, image: RgbPixels, width: int, height: int) -> np.ndarray:
        if self.backend == "pil":
            return np.asarray(
                Image.fromarray(image).resize((width, height), resample=Image.Resampling.BICUBIC)
            )
        from torchvision.transforms.v2 import InterpolationMode
        from torchvision.transforms.v2 import functional as tvf

        chw = torch.from_numpy(image).permute(2, 0, 1)
        resized = tvf.resize(chw, [height, width], interpolation=InterpolationMode.BICUBIC, antialias=True)
        pixels: np.ndarray = resized.permute(1, 2, 0).numpy()
        return pixels
