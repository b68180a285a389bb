"""The policy's repeated blocks (decoder layers, vision blocks): what FSDP shards one by one and what
`trainer.compile` compiles.

A compiled block fuses its elementwise work (norms, rotary embedding, activations, residual adds, casts) into
a few kernels. The blocks of one kind run the same code, so they share one graph: compiling costs about one
block's time, not the model's. `dynamic=True` keeps that one graph for every packed length."""

from __future__ import annotations

import torch


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks transformers marks as never-split (`_no_split_modules`), in module order."""
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in block_classes]
    if not blocks:
        raise TypeError(f"{type(model).__name__} names no decoder layers (_no_split_modules)")
    return blocks


def compile_blocks(model: torch.nn.Module) -> int:
    """Compile every repeated block in place and return how many. `Module.compile` keeps the parameter
    names (checkpoints do not change); call it before FSDP wraps the blocks, so its hooks stay outside the
    compiled code. Code the compiler cannot trace (Qwen-VL's per-image split of vision attention by
    lengths read from a tensor) runs eagerly between the compiled pieces."""
    blocks = repeated_blocks(model)
    for block in blocks:
        block.compile(dynamic=True)
    return len(blocks)
