"""A test environment whose chosen episode deletes its own image from the offload store once the model
has replied: the engine has used the image, the trainer will find it gone. Loaded by the orchestrator
subprocess of a local run as `vanishing:VanishingShapes` (this directory on PYTHONPATH)."""

from __future__ import annotations

from rawmm.contract import OffloadStore
from rawmm.rl.envs import Environment, Episode, ShapesEnvironment, StepResult


class _Vanishing(Episode):
    def __init__(self, inner: Episode, store: OffloadStore) -> None:
        self.inner, self.store, self.path = inner, store, None

    def start(self):
        messages = self.inner.start()
        for part in messages[0]["content"]:
            if part["type"] == "image":
                stored = self.store.put(part.pop("image"))
                part.update(type="image_url", image_url={"url": stored.uri})
                self.path = stored.path
        return messages

    def step(self, reply: str) -> StepResult:
        self.path.unlink()
        return self.inner.step(reply)


class VanishingShapes(Environment):
    def __init__(self, offload_dir: str, victim_seed: int) -> None:
        self.shapes, self.store, self.victim_seed = (
            ShapesEnvironment(),
            OffloadStore(offload_dir),
            victim_seed,
        )

    def episode(self, seed: int) -> Episode:
        episode = self.shapes.episode(seed)
        return _Vanishing(episode, self.store) if seed == self.victim_seed else episode
