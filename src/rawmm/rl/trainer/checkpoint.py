"""Checkpoints on the shared volume: `checkpoints/step_<N>/` plus `checkpoints/latest`.

Each checkpoint is a complete `from_pretrained` directory, so an engine can load it as it loads the
base model: the base checkpoint's own tokenizer, processor, chat template (and remote code) files,
copied byte for byte, plus the trained weights as safetensors and the model config. It is written as
`step_<N>.tmp/` and renamed into place, and `latest` (the newest step, as text) is replaced
atomically after it, so a reader that trusts `latest` never sees a partial checkpoint.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from rawmm.rl.files import write_atomically

LATEST = "latest"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def checkpoint_dir(checkpoints_dir: Path, step: int) -> Path:
    return Path(checkpoints_dir) / f"step_{step}"


def latest_step(checkpoints_dir: Path) -> int:
    """The newest step with a finished checkpoint; 0 (the base model) when there is none."""
    path = Path(checkpoints_dir) / LATEST
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return 0
    if not text.isdigit():
        raise ValueError(f"{path} should hold a step number, found {text[:40]!r}")
    return int(text)


def _is_weights(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json")


def resolve_model_dir(path: str) -> Path:
    """The local directory of a checkpoint given as a directory or a hub id already in the local cache."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, local_files_only=True))


def save_checkpoint(model: Any, base_dir: Path, checkpoints_dir: Path, step: int) -> Path:
    """Write `step_<step>/` (the base checkpoint's non-weight files, then `model` as safetensors),
    then point `latest` at it."""
    checkpoints_dir = Path(checkpoints_dir)
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(checkpoints_dir, step)
    staging = final.with_name(final.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)  # left over from a crash mid-write
    staging.mkdir()
    for source in Path(base_dir).iterdir():
        if source.is_file() and not _is_weights(source.name):
            shutil.copy2(source, staging / source.name)
    model.save_pretrained(staging, safe_serialization=True)
    if final.exists():  # a re-run of this step (e.g. after a restart): the new weights win
        shutil.rmtree(final)
    os.replace(staging, final)
    write_atomically(checkpoints_dir / LATEST, f"{step}\n".encode())
    return final
