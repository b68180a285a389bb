"""Packed attention without a mask: each sample of a micro-batch attends causally within itself.

transformers' `sdpa` gets a packed micro-batch's sample boundaries as a dense block-diagonal mask built
from the position ids (`forward.py`), which keeps PyTorch off its flash kernel and still touches every
pair of tokens across samples. `rawmm_varlen` registers with transformers' attention interfaces a
function that reads the boundaries from the position ids (a sample starts where its position is 0) and
hands them to PyTorch's variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`,
CUDA, in bf16 or fp16: the inputs' dtype or autocast's): no mask is built, and nothing is computed
across samples. Where that kernel cannot run (CPU, fp32 without autocast, a PyTorch without it), the
same call runs `sdpa` with the block-causal mask it builds from the same position ids, so results and
tests agree on every device. Calls without position ids (the Qwen-VL vision
tower, which attends within each image on its own) go to `sdpa` unchanged.

`bench/gpu` measures it against `sdpa` and the other implementations, packed against unpacked.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

VARLEN = "rawmm_varlen"


def _varlen_kernel() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def sample_bounds(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative sample starts `[0, s1, ..., N]` (int32) of a packed `[1, N]` position row, and the
    longest sample's length."""
    row = position_ids.reshape(-1)
    starts = torch.nonzero(row == 0).reshape(-1)
    bounds = torch.cat([starts, starts.new_tensor([row.numel()])]).to(torch.int32)
    return bounds, int((bounds[1:] - bounds[:-1]).max())


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """`[1, 1, N, N]` boolean: token i may attend to token j iff both are in one sample and j <= i."""
    row = position_ids.reshape(-1)
    sample = torch.cumsum((row == 0).to(torch.long), 0)
    index = torch.arange(row.numel(), device=row.device)
    allowed = (sample[:, None] == sample[None, :]) & (index[None, :] <= index[:, None])
    return allowed[None, None]


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: `query` `[1, H, N, D]`, `key`/`value` `[1, Hkv, N, D]`;
    returns `[1, N, H, D]`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.pop("position_ids", None)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if position_ids is None or not causal or query.shape[0] != 1:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    kernel = _varlen_kernel()
    dtype = _half_dtype(query)
    if kernel is None or query.device.type != "cuda" or dropout or dtype is None:
        mask = block_causal_mask(position_ids.to(query.device))
        return sdpa_attention_forward(
            module, query, key, value, mask, dropout=dropout, scaling=scaling, is_causal=False, **kwargs
        )
    bounds, longest = sample_bounds(position_ids.to(query.device))
    q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))  # [N, heads, D]
    options: dict[str, Any] = {"scale": scaling}
    parameters = inspect.signature(kernel).parameters
    if "window_size" in parameters:
        options["window_size"] = (-1, 0)  # causal
    else:
        options["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in parameters:
            options["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    out = kernel(q, k, v, bounds, bounds, longest, longest, **options)
    return out[None].to(query.dtype), None


def _half_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The 16-bit dtype the flash kernel runs in: the inputs' own, or autocast's (under autocast, RoPE
    hands fp32 queries of bf16 projections); None for plain fp32, which the fallback keeps exact."""
    if query.dtype in (torch.float16, torch.bfloat16):
        return query.dtype
    if torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type)
    return None


def register_varlen_attention() -> str:
    """Make `rawmm_varlen` an attention implementation transformers models accept (idempotent); its mask
    is none (flash attention's rule): the boundaries come from the position ids."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(VARLEN, varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, flash_attention_mask)
    return VARLEN
