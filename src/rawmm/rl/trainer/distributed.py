"""Data parallelism over torch.distributed, as launched by torchrun (gloo on CPU, NCCL on GPU).

Every rank reads the whole step batch and packs it identically; rank r trains micro-batches
r, r + world, ... and the gradients are summed across ranks before the optimizer step. Because the
loss is normalized by the step's total loss tokens (not per rank), the summed gradient equals the
single-process gradient, and every rank applies the same update.
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
    """Sum gradients over ranks with one flat all-reduce (a rank without micro-batches sends zeros)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p, g in zip(parameters, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n
