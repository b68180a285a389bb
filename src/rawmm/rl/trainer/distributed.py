"""Data parallelism over torch.distributed, as launched by torchrun (gloo on CPU, NCCL on GPU).

Every rank reads the whole step batch and packs it identically; rank r trains micro-batches
r, r + world, ... and the gradients are summed across ranks before the optimizer step. Because the
loss is normalized by the step's total loss tokens (not per rank), the summed gradient equals the
single-process gradient (none where no rank has one), and every rank applies the same update.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistContext:
    """Join the process group torchrun describes in the environment; a plain run is rank 0 of 1."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return DistContext(rank=0, world_size=1, device=device)
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum `values` over ranks (in place); a no-op in a single process."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def all_reduce_gradients(parameters: list[torch.nn.Parameter]) -> None:
    """Sum gradients over ranks with one flat all-reduce (a rank without micro-batches sends zeros).

    A parameter no rank has a gradient for (the vision tower in a text-only step) keeps none, as in one
    process: AdamW then leaves it alone, where a zero gradient would still move it by its momentum.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    # One more element per parameter, in the same all-reduce: on how many ranks it has a gradient.
    has_grad = torch.tensor(
        [p.grad is not None for p in parameters], dtype=grads[0].dtype, device=grads[0].device
    )
    flat = torch.cat([*(g.reshape(-1) for g in grads), has_grad])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    ranks_with_grad = flat[-len(parameters) :].tolist()
    offset = 0
    for p, g, ranks in zip(parameters, grads, ranks_with_grad, strict=True):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone() if ranks > 0 else None
        offset += n
