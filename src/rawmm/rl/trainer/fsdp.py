"""FSDP2 sharding of the policy: each decoder layer, each vision block and the vision tower are their own
`fully_shard` unit, the root holds the rest (embeddings, final norm, head).

A unit's parameters, gradients and AdamW state live 1/world on each rank (fp32; bf16 compute on GPU,
see `rawmm.rl.trainer.precision`); a unit is all-gathered
right before its forward (and again in backward) and its gradients are reduce-scattered after its
backward. Gradients are *summed* over ranks, not averaged: the loss is already normalized by the
step's loss tokens across all ranks (see `rawmm.rl.trainer.distributed`).

No rank ever holds the whole model on its accelerator, and only rank 0 reads it into host memory:
the others build it on the meta device (no storage), and after sharding rank 0 sends each rank
its shards (`load_from_rank0`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard

from rawmm.rl.trainer.blocks import repeated_blocks
from rawmm.rl.trainer.precision import mixed_precision_policy

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that become FSDP units, innermost first, root last: the repeated blocks (decoder layers,
    vision blocks), then the vision tower, then the model."""
    blocks = repeated_blocks(model)
    get_encoder = getattr(model, "get_encoder", None)  # transformers models have it; nn.Module does not
    vision = get_encoder(modality="image") if get_encoder is not None else model
    towers = [vision] if vision is not model else []
    return [*blocks, *towers, model]


def shard_model(model: torch.nn.Module, device: torch.device) -> None:
    """Apply FSDP2 to `model` in place (every rank of the default process group takes part)."""
    policy = mixed_precision_policy(device)
    for unit in shard_units(model):
        fully_shard(unit, mp_policy=policy)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            # Sum, don't average; and as plain SUM collectives (gloo has no PREMUL_SUM).
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)


def meta_model(path: Path, *, trust_remote_code: bool) -> PreTrainedModel:
    """The checkpoint's model built on the meta device: every shape, no storage, no weights read."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(
            config, dtype=torch.float32, trust_remote_code=trust_remote_code
        )


def load_from_rank0(
    model: torch.nn.Module, full_state: Mapping[str, torch.Tensor], device: torch.device
) -> None:
    """Fill a sharded model from rank 0's `full_state` (other ranks pass `{}`); every rank calls this."""
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
    set_model_state_dict(
        model, dict(full_state), options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    # Buffers the state dict leaves out (rotary frequencies) are still empty on the meta-built ranks.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
