"""A run's shared directory for the GC tests: aged images, rollout batches that reference them, checkpoints."""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from rawmm.contract import OffloadStore, StoredImage, describe_stored_image
from rawmm.contract.files import write_atomically
from rawmm.contract.shared_dir import LATEST, SharedDir
from rawmm.materialize import LoadedProcessor, load_processor
from rawmm.rl.batches import write_batch
from rawmm.rl.samples import RolloutBatch, Sample, build_mm_refs

HOUR = 3600.0


# Fixtures of the GC tests (imported by the modules that use them): a run's shared directory, its offload
# store, and the tiny processor.
@pytest.fixture
def shared(tmp_path: Path) -> SharedDir:
    return SharedDir(tmp_path / "shared")


@pytest.fixture
def store(shared: SharedDir) -> OffloadStore:
    return OffloadStore(shared.offload_dir)


@pytest.fixture(scope="session")
def loaded(tiny_qwen2_vl: Path) -> LoadedProcessor:
    return load_processor(tiny_qwen2_vl)


def png(seed: int, size: int = 28) -> bytes:
    """A distinct small PNG per seed."""
    image = Image.new("RGB", (size, size), (seed % 251, seed // 251 % 251, (seed * 7) % 251))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def age(path: str | Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def image_sample(stored: StoredImage, loaded: LoadedProcessor, sample_id: str) -> Sample:
    """One sample: a token, the image's placeholder tokens, then two completion tokens with loss."""
    descriptor, layout = describe_stored_image(
        loaded.family, loaded.config, stored, fingerprint=loaded.fingerprint
    )
    n = layout.num_placeholder_tokens
    tokens = 1 + n + 2
    return Sample(
        token_ids=[1] * tokens,
        mm_token_type_ids=[0] + [1] * n + [0, 0],
        loss_mask=[False] * (1 + n) + [True, True],
        advantages=[0.0] * (1 + n) + [1.0, 1.0],
        logprobs=[0.0] * (1 + n) + [-1.0, -1.0],
        mm_refs=build_mm_refs([descriptor.to_dict()], [stored.mm_hash], [{"offset": 1, "length": n}]),
        sample_id=sample_id,
    )


def write_step(
    shared: SharedDir, step: int, images: list[StoredImage], loaded: LoadedProcessor
) -> RolloutBatch:
    batch = RolloutBatch(
        step=step, samples=[image_sample(s, loaded, f"s{step}-{i}") for i, s in enumerate(images)]
    )
    write_batch(shared.rollouts_dir, batch)
    return batch


def checkpoint(shared: SharedDir, step: int) -> None:
    """Mark `step` trained (what `save_checkpoint` publishes last; the weights do not matter here)."""
    shared.checkpoints_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(shared.checkpoints_dir / LATEST, f"{step}\n".encode())


def aged_images(store: OffloadStore, seeds: range, seconds: float = 2 * HOUR) -> list[StoredImage]:
    images = [store.put(png(seed)) for seed in seeds]
    for image in images:
        age(image.path, seconds)
    return images


def poll(condition: Callable[[], object], what: str, deadline_s: float = 20.0) -> None:
    """Wait until ``condition()`` is truthy; fail after ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def blocked_on(lock_file: Path) -> bool:
    """Whether some flock waiter is queued on `lock_file` (Linux /proc/locks lists waiters with `->`)."""
    try:
        info = lock_file.stat()
    except FileNotFoundError:  # nobody has locked the directory yet
        return False
    key = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino} "
    return any("->" in line and key in line for line in Path("/proc/locks").read_text().splitlines())
