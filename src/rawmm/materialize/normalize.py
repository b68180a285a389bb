"""uint8 pixels in, the model's normalized float32 pixels out, bit-exact to the processor, where they are used.

Items and trainer micro-batches can hold the resized pixels as ``uint8`` patches (4x smaller than float32) and
leave rescale and normalize to the place the tensor is used (the trainer's device, the transformers engine).
Per channel that transform maps 256 values to 256 values, so it is a table, built once by the processor's
*own* ops on the 256 values (each family's adapter builds it: ``FamilyAdapter.normalization_table``). Its op
order is reproduced by construction, and applying it is a lookup with no arithmetic, so the result has the same bits on any device.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rawmm.materialize.adapters import get_adapter
from rawmm.materialize.processor import LoadedProcessor

PIXEL_KEY = "pixel_values"  # the one image kwarg normalization applies to, in every family
_BLOCK_ROWS = 4096  # patch rows per lookup block: a Qwen block's int32 index is 18 MiB


class PixelNormalizer:
    """Normalizes uint8 ``pixel_values`` (any family's patch layout: channel-major within a patch row)."""

    def __init__(self, processor: LoadedProcessor) -> None:
        self._table = get_adapter(processor.family.name).normalization_table(processor.processor)
        self._per_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.dtype != torch.uint8:
            # Normalized pixels are float: a second pass would silently double-normalize them.
            raise TypeError(
                f"pixel_values must be uint8 to normalize, got {pixel_values.dtype} (normalized twice?)"
            )
        table, offsets = self._on(pixel_values.device)
        flat = table.flatten()
        rows = pixel_values.reshape(pixel_values.shape[0], table.shape[0], -1)
        out = torch.empty(rows.shape, dtype=torch.float32, device=rows.device)
        # In blocks of rows, so the int32 lookup index stays a few MiB beside the float32 output;
        # index_select is ~3x faster than advanced indexing on CPU.
        for start in range(0, rows.shape[0], _BLOCK_ROWS):
            block = rows[start : start + _BLOCK_ROWS]
            index = (block.to(torch.int32) + offsets).flatten()
            torch.index_select(flat, 0, index, out=out[start : start + block.shape[0]].view(-1))
        return out.reshape(pixel_values.shape)

    def inputs(self, mm_kwargs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``mm_kwargs`` with its uint8 ``pixel_values`` normalized, on their device."""
        out = dict(mm_kwargs)
        if PIXEL_KEY in out:
            out[PIXEL_KEY] = self(out[PIXEL_KEY])
        return out

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._per_device:
            channels = self._table.shape[0]
            offsets = (torch.arange(channels, dtype=torch.int32) * 256).view(1, channels, 1)
            self._per_device[device] = (self._table.to(device), offsets.to(device))
        return self._per_device[device]
