"""Qwen-VL uint8 patches on the torchvision backend: the engine's miss path for vLLM (device-normalized items).

The pixels are transformers' own: the decoded RGB rows as its tensor conversion lays them out, and its resize (``smart_resize`` plus torchvision's
antialiased resampling, with the checkpoint's settings). Only the patchify is ours, because it is the one
step left that costs more than the resize. transformers lays the patches out with one 8-d gather whose
innermost reads stride over the channels-last resize output and duplicate every pixel ``temporal_patch_size``
times. Here one gather fills the first temporal slot and a contiguous copy fills the rest: the same bytes
(a test compares them with transformers' output), about half the time. The copies are numpy's, which
release the GIL and start no intra-op threads, so worker threads materializing in parallel each use one core.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rawmm.materialize.read import RgbPixels


def patchify(pixels: torch.Tensor, *, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """A resized ``(C, H, W)`` uint8 image as ``(grid_h·grid_w, C·temporal·patch·patch)`` rows, in the order
    of transformers' Qwen2-VL ``patchify``: merge blocks row-major, then the patches within a block, then
    channel, temporal copy, patch row, patch column."""
    channels, height, width = pixels.shape
    grid_h, grid_w = height // patch, width // patch
    # Splitting axes is a view for any strides, so this reads the resize output where it lies.
    source = (
        pixels.numpy()
        .reshape(channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
        .transpose(1, 4, 2, 5, 0, 3, 6)
    )
    out = np.empty(
        (grid_h // merge, grid_w // merge, merge, merge, channels, temporal, patch, patch), np.uint8
    )
    out[:, :, :, :, :, 0] = source
    out[:, :, :, :, :, 1:] = out[:, :, :, :, :, :1]
    return torch.from_numpy(out.reshape(grid_h * grid_w, channels * temporal * patch * patch))


def uint8_patches(processor: Any, images: Sequence[RgbPixels]) -> dict[str, torch.Tensor]:
    """What ``processor(images, do_rescale=False, do_normalize=False)`` returns for transformers'
    ``Qwen2VLImageProcessor`` (torchvision backend): ``pixel_values`` as uint8 rows and ``image_grid_thw``."""
    patch, merge, temporal = processor.patch_size, processor.merge_size, processor.temporal_patch_size
    rows, grids = [], []
    for image in images:
        # The channels-first view of the decoded rows, as transformers makes of a PIL image or an array.
        pixels = torch.from_numpy(image).permute(2, 0, 1)
        if processor.do_resize:
            pixels = processor.resize(
                pixels[None], size=processor.size, resample=processor.resample, factor=patch * merge
            )[0]
        rows.append(patchify(pixels, patch=patch, merge=merge, temporal=temporal))
        grids.append([1, pixels.shape[1] // patch, pixels.shape[2] // patch])
    return {
        "pixel_values": rows[0] if len(rows) == 1 else torch.cat(rows),
        "image_grid_thw": torch.tensor(grids, dtype=torch.long).reshape(-1, 3),
    }
