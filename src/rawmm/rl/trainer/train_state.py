"""The trainer's resume state: model, AdamW state and step, saved with torch.distributed.checkpoint.

Each rank writes its own shards (FSDP) or one rank writes each replicated tensor (DDP, one process),
so resuming restores exactly the weights and optimizer moments the run had, on any of the layouts
the state was written from. The engines never read this: they load the gathered safetensors next to it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


@contextmanager
def _single_process_quietly() -> Iterator[None]:
    # Without a process group DCP warns that it assumes one process, which is what `no_dist` already says.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class MissingTrainState(FileNotFoundError):
    """A checkpoint to resume from holds no trainer state."""


def save_train_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, path: Path) -> None:
    """Write the state under `path` (every rank calls this)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": step}
    with _single_process_quietly():
        dcp.save(state, checkpoint_id=path, no_dist=not dist.is_initialized())


def load_train_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> int:
    """Restore `model` and `optimizer` in place from `path` (every rank calls this); returns the step."""
    if not (Path(path) / ".metadata").is_file():
        raise MissingTrainState(f"{path}: no trainer state to resume from (model, optimizer and step)")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state, "step": -1}
    with _single_process_quietly():
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return int(state["step"])
