"""The trainer's precision policy: what runs in which dtype, the same on any number of ranks.

On a GPU the forward and backward compute in bf16 while the weights the optimizer updates (the master
copy), their gradients and AdamW's two moments stay fp32; on CPU everything is fp32 (bf16 matmuls are
slow there, and fp32 keeps runs comparable across process counts). How the bf16 compute is reached
depends only on the parallelism:
- unsharded (`ddp`, one rank or many): the fp32 model runs its forward under `torch.autocast(bf16)`,
  which casts each weight for the ops that take bf16 (matmuls, attention) and keeps reductions such as
  softmax and norms in fp32; backward follows the forward's dtypes.
- sharded (`fsdp` on two ranks or more): FSDP2's `MixedPrecisionPolicy` all-gathers each unit's
  weights as bf16 and reduce-scatters its gradients in fp32 into the fp32 shards.

State bytes per parameter (P parameters, N ranks), docs/architecture.md §5: fp32 weights 4 + fp32
gradients 4 + AdamW moments 8 = 16 B/param, held whole on every rank unsharded and 16/N under FSDP;
the bf16 copies are transient (the units or weights a forward/backward is using, 2 B/param at most).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

# Bytes a rank holds per parameter across steps: fp32 master weight, fp32 gradient, AdamW exp_avg and exp_avg_sq.
STATE_BYTES_PER_PARAM = 4 + 4 + 4 + 4


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype forward and backward compute in on `device`."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def autocast(device: torch.device) -> AbstractContextManager[object]:
    """The context an unsharded model's forward runs in: bf16 autocast on GPU, nothing on CPU."""
    dtype = compute_dtype(device)
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def mixed_precision_policy(device: torch.device) -> MixedPrecisionPolicy:
    """FSDP2's side of the policy: units gathered in the compute dtype, gradients reduced in fp32 (the
    fp32 shards are the master weights)."""
    dtype = compute_dtype(device)
    if dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
