"""The layout of a run's shared directory, where the orchestrator and the trainer meet, and the waits on it.

```
<shared_dir>/images/                          the offload store (`rawmm.contract.store`)
<shared_dir>/rollouts/step_<N>.msgpack        the orchestrator's batch for step N, written atomically
<shared_dir>/checkpoints/step_<N>/            the trainer's checkpoint after step N (a from_pretrained dir)
<shared_dir>/checkpoints/step_<N>/trainer_state/   what a resume needs (the newest checkpoint only)
<shared_dir>/checkpoints/step_<N>.tmp/        a checkpoint being written
<shared_dir>/checkpoints/latest               the newest finished step, as text, replaced after its dir
```

Every name of that layout is here and nowhere else; the orchestrator, the trainer, offload retention,
`rawmm run` and the run config all derive their paths from it. A reader that trusts `latest` and whole
batch files never sees a partial write. Every wait takes the timeout the caller chose (the run config's, by
default) and polls the directory, since the peer is another process, possibly on another node.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from pathlib import Path

LATEST = "latest"
TRAIN_STATE = "trainer_state"
_BATCH_NAME = re.compile(r"^step_(\d+)\.msgpack$")
_CHECKPOINT_NAME = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class SharedDir:
    """The top-level directories of a run's shared directory."""

    path: Path

    @property
    def offload_dir(self) -> Path:
        return self.path / "images"

    @property
    def rollouts_dir(self) -> Path:
        return self.path / "rollouts"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    def holds_a_run(self) -> bool:
        """Whether a run already wrote batches or published a checkpoint here."""
        return bool(written_steps(self.rollouts_dir)) or latest_path(self.checkpoints_dir).exists()


class BatchTimeout(TimeoutError):
    """No rollout batch appeared for a step within the allowed time."""


class CheckpointTimeout(TimeoutError):
    """The trainer's checkpoint for a step did not appear within the allowed time (the mirror of
    `BatchTimeout`: neither side waits forever for a peer that is gone)."""


def batch_path(rollouts_dir: Path, step: int) -> Path:
    return Path(rollouts_dir) / f"step_{step}.msgpack"


def written_steps(rollouts_dir: Path) -> list[int]:
    """Steps whose batch is on disk, ascending."""
    return _steps(Path(rollouts_dir), _BATCH_NAME)


def checkpoint_dir(checkpoints_dir: Path, step: int) -> Path:
    return Path(checkpoints_dir) / f"step_{step}"


def staging_dir(checkpoints_dir: Path, step: int) -> Path:
    """Where the checkpoint of `step` is written before it is renamed into place."""
    return Path(checkpoints_dir) / f"step_{step}.tmp"


def train_state_dir(checkpoints_dir: Path, step: int) -> Path:
    return checkpoint_dir(checkpoints_dir, step) / TRAIN_STATE


def checkpoint_steps(checkpoints_dir: Path) -> list[int]:
    """Steps with a checkpoint directory in place (renamed from staging), ascending."""
    return _steps(Path(checkpoints_dir), _CHECKPOINT_NAME, directories=True)


def latest_path(checkpoints_dir: Path) -> Path:
    return Path(checkpoints_dir) / LATEST


def latest_step(checkpoints_dir: Path) -> int:
    """The newest step with a finished checkpoint; 0 (the base model) when there is none."""
    return read_step(latest_path(checkpoints_dir))


def read_step(path: Path) -> int:
    """The step number a marker file (`latest`, `weights_step`) holds; 0 when it does not exist yet."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return 0
    if not text.isdigit():
        raise ValueError(f"{path} should hold a step number, found {text[:40]!r}")
    return int(text)


def wait_for_batch_file(rollouts_dir: Path, step: int, *, timeout_s: float, poll_s: float = 0.2) -> Path:
    """The path of step `step`'s batch once it exists; `BatchTimeout` after `timeout_s` seconds."""
    path = batch_path(rollouts_dir, step)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() >= deadline:
            raise BatchTimeout(f"no rollout batch for step {step} at {path} after {timeout_s:.0f}s")
        time.sleep(poll_s)
    return path


async def wait_for_checkpoint(
    checkpoints_dir: Path, step: int, *, timeout_s: float, poll_s: float = 0.2
) -> int:
    """The latest checkpoint step once it is at least `step`; `CheckpointTimeout` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (latest := latest_step(checkpoints_dir)) < step:
        if time.monotonic() >= deadline:
            raise CheckpointTimeout(
                f"no trainer checkpoint for step {step} in {checkpoints_dir} after {timeout_s:.0f}s"
            )
        await asyncio.sleep(poll_s)
    return latest


def _steps(directory: Path, name: re.Pattern[str], *, directories: bool = False) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(
        int(match.group(1))
        for entry in directory.iterdir()
        if (match := name.match(entry.name)) and (entry.is_dir() or not directories)
    )
