"""A tiny run on disk: config, offloaded images and on-policy rollout batches for the trainer tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import torch
from PIL import Image

from rawmm.config import RunConfig
from rawmm.contract import OffloadStore, RawImageDescriptor
from rawmm.materialize import load_processor
from rawmm.rl.batches import write_batch
from rawmm.rl.orchestrator.rollout import PromptRenderer
from rawmm.rl.samples import RolloutBatch, Sample, completion_sample
from rawmm.rl.trainer.forward import forward_logprobs
from rawmm.rl.trainer.loss import LossParts, policy_gradient_loss
from rawmm.rl.trainer.materializer import MaterializedMicroBatch, RawImageMaterializer
from rawmm.rl.trainer.packing import PackedMicroBatch, concat_samples


def random_image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def run_config(model: Path, shared_dir: Path, **trainer: object) -> RunConfig:
    return RunConfig.from_mapping(
        {
            "model": {"path": str(model), "preset": "qwen2_vl"},
            "shared_dir": str(shared_dir),
            "trainer": {
                "steps": 2,
                "learning_rate": 1e-3,
                "seq_len": 512,
                "micro_batch_tokens": 512,
                **trainer,
            },
            "monitoring": {"trainer_metrics_port": 0, "orchestrator_metrics_port": 0},
        }
    )


class RolloutFactory:
    """Renders chats with images into samples whose old logprobs are the base model's own (on-policy)."""

    def __init__(self, config: RunConfig) -> None:
        from transformers import AutoModelForImageTextToText

        from rawmm.materialize import get_adapter

        self.config = config
        self.renderer = PromptRenderer(
            config.model.path,
            config.model.preset,
            config.model.processor_backend,
            OffloadStore(config.offload_dir),
        )
        self.loaded = load_processor(config.model.path)
        self.adapter = get_adapter(self.loaded.family.name)
        self.model = AutoModelForImageTextToText.from_pretrained(
            config.model.path, dtype=torch.float32
        ).eval()
        self.images: dict[str, list[Image.Image]] = {}  # sample id -> its images, in order

    def sample(self, images: list[Image.Image], completion: str, advantage: float, sample_id: str) -> Sample:
        content = [
            *({"type": "image", "image": im} for im in images),
            {"type": "text", "text": "what is it?"},
        ]
        prompt = self.renderer.render(self.renderer.offload([{"role": "user", "content": content}]))
        completion_ids = self.renderer.tokenizer.encode(completion)
        sample = completion_sample(
            prompt,
            completion_ids,
            [0.0] * len(completion_ids),
            advantage=advantage,
            reward=max(advantage, 0.0),
            sample_id=sample_id,
        )
        self.images[sample_id] = images
        return msgspec.structs.replace(sample, logprobs=self.logprobs(sample))

    def logprobs(self, sample: Sample) -> list[float]:
        """Per-token logprobs of `sample` under `self.model`, as the engine would have reported them."""
        images = [np.array(image) for image in self.images[sample.sample_id]]  # as the read decodes them
        descriptors = [RawImageDescriptor.from_dict(r.descriptor) for r in sample.mm_refs]
        kwargs = (
            self.adapter.materialize_for_trainer(images, descriptors, self.loaded).kwargs if images else {}
        )
        with torch.no_grad():
            return forward_logprobs(
                self.model, concat_samples([sample]), kwargs, self.adapter.forward_policy
            ).tolist()

    def delete_image(self, uri: str) -> None:
        self.renderer.store.resolve(uri).unlink()

    def write(self, step: int, samples: list[Sample]) -> Path:
        return write_batch(self.config.rollouts_dir, RolloutBatch(step=step, samples=samples))

    def standard_batch(self, seed: int = 0) -> list[Sample]:
        """Two groups: a shared prompt image per group, one rollout with a second (zoomed) image."""
        shared = [random_image(84, 56, seed), random_image(56, 84, seed + 1)]
        samples = []
        for g, image in enumerate(shared):
            samples.append(self.sample([image], " a red circle", 1.0, f"g{g}-r0"))
            samples.append(
                self.sample([image, random_image(60, 60, seed + 10 + g)], " two blue", -1.0, f"g{g}-r1")
            )
        samples.append(self.sample([], " hello there", 0.5, "text-only"))
        return samples


def torchrun_train(config_file: Path, steps: int) -> list[dict]:
    """`rawmm train` on 2 gloo ranks under torchrun; the JSON lines it prints (one per step)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["-m", "rawmm.cli", "train", str(config_file), "--steps", str(steps), "--batch-timeout", "30"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    # Every rank's error lines first: the tail alone may show only the rank that lost its peer.
    errors = [line for line in done.stderr.splitlines() if "Error" in line or "error" in line]
    assert done.returncode == 0, "\n".join(errors[-30:]) + "\n...\n" + done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"')]


def shared_image_micro_batch(
    model_dir: Path, preset: str, store: OffloadStore
) -> tuple[MaterializedMicroBatch, RawImageMaterializer]:
    """Three samples of a group sharing its prompt image `a`, one also showing `b`, and one text-only:
    5 placeholder spans of 2 distinct images."""
    renderer = PromptRenderer(model_dir, preset, "pil", store)
    a, b = random_image(84, 56, 1), random_image(56, 56, 2)

    def sample(images, reply: str, advantage: float, sample_id: str):
        content = [*({"type": "image", "image": im} for im in images), {"type": "text", "text": "what?"}]
        prompt = renderer.render(renderer.offload([{"role": "user", "content": content}]))
        tokens = renderer.tokenizer.encode(reply)
        return completion_sample(
            prompt, tokens, [-1.0] * len(tokens), advantage=advantage, sample_id=sample_id
        )

    samples = [
        sample([a], " a red circle", 1.0, "r0"),
        sample([a, b], " two blue", -1.0, "r1"),
        sample([a, b], " a star", 0.5, "r2"),
        sample([], " hello", 0.5, "text"),
    ]
    materializer = RawImageMaterializer(
        load_processor(model_dir, backend="pil"), roots=[store.root], missing_image_policy="error"
    )
    materializer.begin_step(1)
    return materializer.materialize(concat_samples(samples)), materializer


def batch_loss(
    new: torch.Tensor, batch: PackedMicroBatch, mask: torch.Tensor, *, step_tokens: int
) -> LossParts:
    """The trainer's loss of `new` logprobs on `batch` (its engine logprobs and advantages) at the default clip
    ratios."""
    return policy_gradient_loss(
        new,
        torch.tensor(batch.logprobs),
        torch.tensor(batch.advantages),
        mask,
        clip_low=0.2,
        clip_high=0.28,
        step_tokens=step_tokens,
    )


def loss_and_grads(
    model: torch.nn.Module, m: MaterializedMicroBatch, materializer: RawImageMaterializer, *, once: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[int]]:
    """The step's loss, every parameter's gradient, and the patch rows each vision-tower call saw."""
    patches: list[int] = []
    vision = model.get_encoder(modality="image")
    hook = vision.register_forward_pre_hook(lambda _, args: patches.append(args[0].shape[0]))
    kwargs, index = m.unique_mm_kwargs() if once else (m.mm_kwargs(), None)
    model.zero_grad(set_to_none=True)
    policy, normalizer = materializer.forward_policy, materializer.normalizer
    new = forward_logprobs(model, m.batch, kwargs, policy, normalizer=normalizer, image_index=index)
    mask = torch.tensor(m.batch.loss_mask)
    parts = batch_loss(new, m.batch, mask, step_tokens=int(mask.sum()))
    parts.loss.backward()
    hook.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return parts.loss.detach(), grads, patches
