"""Checkpoints on the shared volume: `checkpoints/step_<N>/` plus `checkpoints/latest`.

Each checkpoint is a complete `from_pretrained` directory (safetensors weights, config, processor and
tokenizer files), so an engine can load it as it loads the base model. It is written as
`step_<N>.tmp/` and renamed into place, and `latest` (the newest step, as text) is replaced
atomically after it, so a reader that trusts `latest` never sees a partial checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

LATEST = "latest"


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


def _write_text_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(model: Any, processor: Any, checkpoints_dir: Path, step: int) -> Path:
    """Write `model` (safetensors) and `processor` as `step_<step>/`, then point `latest` at it."""
    checkpoints_dir = Path(checkpoints_dir)
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(checkpoints_dir, step)
    staging = final.with_name(final.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)  # left over from a crash mid-write
    model.save_pretrained(staging, safe_serialization=True)
    processor.save_pretrained(staging)
    if final.exists():  # a re-run of this step (e.g. after a restart): the new weights win
        shutil.rmtree(final)
    os.replace(staging, final)
    _write_text_atomically(checkpoints_dir / LATEST, f"{step}\n")
    return final
