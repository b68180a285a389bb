"""Checkpoints on the shared volume: `checkpoints/step_<N>/` plus `checkpoints/latest`
(the names: `rawmm.contract.shared_dir`).

Each checkpoint is a complete `from_pretrained` directory, so an engine can load it as it loads the
base model: the base checkpoint's own tokenizer, processor, chat template (and remote code) files,
copied byte for byte, plus the trained weights as safetensors (gathered on rank 0) and the model
config. Next to them, `trainer_state/` holds what a resume needs (`rawmm.rl.trainer.train_state`);
only the newest checkpoint keeps it, since nothing resumes from an older one. The checkpoint is
written as `step_<N>.tmp/` and renamed into place, and `latest` (the newest step, as text) is
replaced atomically after it, so a reader that trusts `latest` never sees a partial checkpoint.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from rawmm.contract import detect_family
from rawmm.contract.files import write_atomically
from rawmm.contract.shared_dir import (
    TRAIN_STATE,
    checkpoint_dir,
    checkpoint_steps,
    latest_path,
    staging_dir,
    train_state_dir,
)
from rawmm.materialize import get_adapter
from rawmm.rl.trainer.train_state import save_train_state

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _is_weights(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json")


def resolve_model_dir(path: str) -> Path:
    """The local directory of a checkpoint given as a directory or a hub id already in the local cache."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, local_files_only=True))


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _share_tied(model: torch.nn.Module, weights: dict[str, Any]) -> dict[str, Any]:
    """Names of one parameter (tied embeddings) point at one gathered tensor, as in the model itself, so
    `save_pretrained` writes it once, as it does for an unsharded model (rank 0's dict; others are empty)."""
    owners: dict[int, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        owner = owners.setdefault(id(parameter), name)
        if owner != name and owner in weights and name in weights:
            weights[name] = weights[owner]
    return weights


def save_checkpoint(
    model: Any,
    optimizer: torch.optim.Optimizer,
    base_dir: Path,
    checkpoints_dir: Path,
    step: int,
    *,
    is_main: bool,
) -> Path:
    """Write `step_<step>/` and point `latest` at it; every rank calls this (the gathers are collective).

    Rank 0 writes the base checkpoint's non-weight files and the gathered weights, every rank its part
    of the trainer state; the directory is published once all of it is on disk.
    """
    checkpoints_dir = Path(checkpoints_dir)
    final = checkpoint_dir(checkpoints_dir, step)
    staging = staging_dir(checkpoints_dir, step)
    if is_main:
        shutil.rmtree(staging, ignore_errors=True)  # left over from a crash mid-write
        staging.mkdir(parents=True)
        for source in Path(base_dir).iterdir():
            if source.is_file() and not _is_weights(source.name):
                shutil.copy2(source, staging / source.name)
    _barrier()  # no rank writes its state into a staging directory that rank 0 is still clearing
    weights = _share_tied(
        model, get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    )
    save_train_state(model, optimizer, step, staging / TRAIN_STATE)
    if is_main:
        model.save_pretrained(staging, state_dict=weights, safe_serialization=True)
        # In the format the engines serve (Kimi K2.5: transformers saves it off the published one, which
        # vLLM's reload would refuse as weights that do not fit).
        get_adapter(detect_family(staging).name).publish_checkpoint(staging)
        if final.exists():  # a re-run of this step (e.g. after a restart): the new weights win
            shutil.rmtree(final)
        os.replace(staging, final)
        write_atomically(latest_path(checkpoints_dir), f"{step}\n".encode())
        for older in checkpoint_steps(checkpoints_dir):
            if older != step and (state := train_state_dir(checkpoints_dir, older)).exists():
                shutil.rmtree(state)
    _barrier()  # no rank runs ahead of a checkpoint it may be asked about
    return final
