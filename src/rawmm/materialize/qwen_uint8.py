"""Qwen-VL uint8 patches on the torchvision backend: the engine's miss path for vLLM (device-normalized items).

The pixels are transformers' own: the decoded RGB rows as its tensor conversion lays them out, and its resize (``smart_resize`` plus torchvision's
antialiased resampling, with the checkpoint's settings). For bicubic (the Qwen-VL checkpoints') the resize
calls torchvision's kernel (``interpolate`` on uint8) itself: transformers' and torchvision's layers above
it cost ~0.2 ms under the GIL a miss, a fifth of all the GIL a miss holds, which two worker threads
cannot overlap. The patchify is ours because it is the one step left that costs more than the resize. transformers lays the patches out with one 8-d gather whose
innermost reads stride over the channels-last resize output and duplicate every pixel ``temporal_patch_size``
times. Here one gather fills the first temporal slot and a broadcast copy fills all of them: the same bytes
(a test compares them with transformers' output), about half the time. The copies are numpy's, which
release the GIL and start no intra-op threads, so worker threads materializing in parallel each use one core.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rawmm.materialize.read import RgbPixels


def resize_bicubic(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """What torchvision's ``resize_image`` makes of a ``(C, H, W)`` uint8 CPU image, bicubic and antialiased:
    its native uint8 kernel on the same strides (a test compares the two)."""
    if pixels.shape[1:] == (height, width):
        return pixels
    batch = pixels[None]
    if batch.is_contiguous(memory_format=torch.channels_last) and batch.numel() != batch.stride(0):
        # torchvision's restride, so that interpolate keeps a channels-last image channels-last.
        batch = batch.as_strided(batch.shape, (batch.numel(), *batch.stride()[1:]))
    resized = torch.nn.functional.interpolate(
        batch, size=[height, width], mode="bicubic", align_corners=False, antialias=True
    )
    return resized[0]


def resize(processor: Any, pixels: torch.Tensor) -> torch.Tensor:
    """The processor's own resize of a ``(C, H, W)`` uint8 image: ``smart_resize``'s size, then torchvision's
    resampling (its kernel called directly for bicubic)."""
    from torchvision.transforms.v2 import InterpolationMode
    from transformers.image_utils import pil_torch_interpolation_mapping
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    factor, size = processor.patch_size * processor.merge_size, processor.size
    bicubic = pil_torch_interpolation_mapping.get(processor.resample) == InterpolationMode.BICUBIC
    if not (bicubic and size.shortest_edge and size.longest_edge):
        resized: torch.Tensor = processor.resize(
            pixels[None], size=processor.size, resample=processor.resample, factor=factor
        )[0]
        return resized
    height, width = smart_resize(
        pixels.shape[1],
        pixels.shape[2],
        factor=factor,
        min_pixels=size.shortest_edge,
        max_pixels=size.longest_edge,
    )
    return resize_bicubic(pixels, height, width)


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
    blocks = (grid_h // merge, grid_w // merge, merge, merge, channels)
    first = np.empty((*blocks, 1, patch, patch), np.uint8)
    first[:, :, :, :, :, 0] = source
    # Broadcast from an array of its own: copying slot 0 of `out` into the others would be a copy within
    # one array, which numpy cannot prove disjoint and stages through a temporary (one more copy).
    out = np.empty((*blocks, temporal, patch, patch), np.uint8)
    out[...] = first
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
            pixels = resize(processor, pixels)
        rows.append(patchify(pixels, patch=patch, merge=merge, temporal=temporal))
        grids.append([1, pixels.shape[1] // patch, pixels.shape[2] // patch])
    return {
        "pixel_values": rows[0] if len(rows) == 1 else torch.cat(rows),
        "image_grid_thw": torch.tensor(grids, dtype=torch.long).reshape(-1, 3),
    }
