"""Trainer-side materialization of one RL step: deduplicated vs not, and its share of a training step.

A step of 8 groups x 8 rollouts, 4 turns each, one new image per turn: turn 1 shows the group's
prompt image (shared by its 8 rollouts), turns 2-4 each show a new image of that rollout. The
conversation keeps every earlier image. Two ways to cut it into samples:
- `rollout`: one sample per rollout holding all 4 turns (64 samples, 256 image refs);
- `per-turn`: one sample per turn, as the orchestrator ships them (256 samples, 640 image refs).
Either way the step has 8 + 64 x 3 = 200 unique images. For each layout the same packed micro-batches
are materialized with and without per-step dedupe (images read+processed, seconds), then a full
training step on the tiny Qwen2-VL model (`Trainer.train_step`, rollout layout) gives
materialization's share of it.

    .venv/bin/python bench/trainer_materialize.py [--repeats 3] [--size 480x300]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from PIL import Image, ImageDraw

GROUPS, ROLLOUTS, TURNS = 8, 8, 4
ANSWER = "zoom in on the top left panel"


def screenshot(seed: int, size: tuple[int, int]) -> Image.Image:
    """A synthetic UI-like image: flat panels and boxes (compresses like a screenshot, unlike noise)."""
    rng = random.Random(seed)
    image = Image.new("RGB", size, tuple(rng.randrange(200, 256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(40):
        x, y = rng.randrange(size[0]), rng.randrange(size[1])
        w, h = rng.randrange(10, size[0] // 3), rng.randrange(8, size[1] // 4)
        draw.rectangle((x, y, x + w, y + h), fill=tuple(rng.randrange(256) for _ in range(3)))
    return image


def conversations(size: tuple[int, int]) -> list[tuple[str, float, list[Image.Image]]]:
    """(rollout id, advantage, its turn images); turn 1 is the group's shared prompt image."""
    rollouts = []
    for g in range(GROUPS):
        prompt_image = screenshot(g, size)
        for r in range(ROLLOUTS):
            turns = [
                prompt_image,
                *(screenshot(1000 + (g * ROLLOUTS + r) * TURNS + t, size) for t in range(1, TURNS)),
            ]
            rollouts.append((f"g{g}-r{r}", 1.0 if r % 2 else -1.0, turns))
    return rollouts


class SampleRenderer:
    """Renders conversations with the contract (offloading every image) into training samples."""

    def __init__(self, config) -> None:  # noqa: ANN001
        from transformers import AutoTokenizer

        from rawmm.contract import OffloadStore, resolve_preset

        self.family, _ = resolve_preset(config.model.preset)
        self.family_config = self.family.config_from_pretrained(config.model.path)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        self.store = OffloadStore(config.offload_dir)
        self.answer = self.tokenizer.encode(" " + ANSWER)

    def sample(self, images: list[Image.Image], sample_id: str, advantage: float):  # noqa: ANN201
        from rawmm.contract import render_chat
        from rawmm.rl.samples import completion_sample

        messages: list = []
        for t, image in enumerate(images):
            if t:
                messages.append({"role": "assistant", "content": ANSWER})
            text = "here is the new view" if t else "what should we look at?"
            messages.append(
                {
                    "role": "user",
                    "content": [{"type": "image", "image": image}, {"type": "text", "text": text}],
                }
            )
        prompt = render_chat(
            messages,
            tokenizer=self.tokenizer,
            family=self.family,
            config=self.family_config,
            store=self.store,
        )
        return completion_sample(
            prompt, self.answer, [-1.0] * len(self.answer), advantage=advantage, sample_id=sample_id
        )


def build_samples(config, layout: str, size: tuple[int, int]) -> list:  # noqa: ANN001
    renderer = SampleRenderer(config)
    samples = []
    for rollout_id, advantage, images in conversations(size):
        if layout == "rollout":
            samples.append(renderer.sample(images, rollout_id, advantage))
        else:
            samples.extend(
                renderer.sample(images[: t + 1], f"{rollout_id}-t{t}", advantage) for t in range(TURNS)
            )
    return samples


def time_materialization(loaded, roots, micro_batches, repeats: int) -> dict[bool, tuple[int, int, float]]:  # noqa: ANN001
    """dedupe on/off -> (image refs, images materialized, fastest seconds) for one step's micro-batches.

    The two variants alternate within each repeat so that load from other processes hits both alike."""
    from rawmm.rl.trainer.materializer import RawImageMaterializer

    materializers = {
        dedupe: RawImageMaterializer(loaded, roots=roots, missing_image_policy="error", dedupe=dedupe)
        for dedupe in (True, False)
    }
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for step in range(repeats):
        for dedupe, materializer in materializers.items():
            materializer.begin_step(step)
            started = time.perf_counter()
            for mb in micro_batches:
                materializer.materialize(mb)
            seconds[dedupe].append(time.perf_counter() - started)
    return {
        dedupe: (m.stats.images, m.stats.materialized, min(seconds[dedupe]))
        for dedupe, m in materializers.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed passes per variant (the fastest counts)"
    )
    parser.add_argument("--size", default="480x300", help="image size WxH (default 480x300)")
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))

    from rawmm.config import RunConfig
    from rawmm.materialize import load_processor
    from rawmm.rl.samples import RolloutBatch, truncate_sample
    from rawmm.rl.trainer.distributed import init_distributed
    from rawmm.rl.trainer.loop import Trainer
    from rawmm.rl.trainer.packing import pack_samples
    from rawmm.run.tiny import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="rawmm-bench-") as tmp:
        model = build_tiny_model("qwen2_vl", Path(tmp) / "tiny-qwen2-vl")
        loaded = load_processor(model)
        print(
            f"tiny Qwen2-VL; images {width}x{height}; {GROUPS} groups x {ROLLOUTS} rollouts x {TURNS} turns\n"
        )
        header = (
            f"{'layout':>9} {'samples':>7} {'refs':>5} {'unique':>6} {'refs/unique':>11} | "
            f"{'dedupe: images':>14} {'s':>6} | {'no dedupe: images':>17} {'s':>6} | {'time ratio':>10}"
        )
        print(header)
        print("-" * len(header))
        for layout in ("rollout", "per-turn"):
            config = RunConfig.from_mapping(
                {
                    "model": {"path": str(model), "preset": "qwen2_vl"},
                    "shared_dir": str(Path(tmp) / layout),
                    "trainer": {"seq_len": 4096, "micro_batch_tokens": 8192},
                    "monitoring": {"trainer_metrics_port": 0},
                }
            )
            samples = [
                truncate_sample(s, config.trainer.seq_len)
                for s in build_samples(config, layout, (width, height))
            ]
            micro_batches = pack_samples(samples, config.trainer.micro_batch_tokens)
            unique = len({r.mm_hash for s in samples for r in s.mm_refs})
            roots = [config.offload_dir]
            timings = time_materialization(loaded, roots, micro_batches, args.repeats)
            (refs, with_n, with_s), (_, without_n, without_s) = timings[True], timings[False]
            print(
                f"{layout:>9} {len(samples):>7} {refs:>5} {unique:>6} {refs / unique:>11.2f} | "
                f"{with_n:>14} {with_s:>6.2f} | {without_n:>17} {without_s:>6.2f} | {without_s / with_s:>10.2f}"
            )
            if layout == "rollout":
                train_config, train_samples, train_micro = config, samples, len(micro_batches)

        # A real training step on the 64-sample batch; the second runs warm and is the one reported.
        trainer = Trainer(train_config, init_distributed())
        batch = RolloutBatch(step=1, samples=train_samples)
        result = [trainer.train_step(batch) for _ in range(2)][-1]
        share = result.materialize_seconds / result.step_seconds
        print(
            f"\ntraining step, rollout layout (tiny model, dedupe on, second of two): {result.tokens} tokens "
            f"in {train_micro} micro-batches, {result.step_seconds:.2f}s; materialization "
            f"{result.materialize_seconds:.2f}s = {share:.1%} of the step "
            f"({result.images_materialized} images materialized for {result.images} refs)"
        )


if __name__ == "__main__":
    main()
