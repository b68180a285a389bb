"""What a multi-turn rollout costs the trainer: one sample per turn (before) vs one per branch (after).

Rollouts of the `shapes-multiturn` environment (as many views as turns) are played through the
orchestrator's own `play` (the real renderer and tokenizer of a tiny Qwen2-VL) against a scripted engine
that ends every turn: the first rollout of a group replies `next`, the second `crop top-left`, so each
turn adds a new image, a group shares only its first one, and every prompt extends the previous turn's.
- before: `turn_samples` (one sample per turn), every placeholder span encoded by the vision tower;
- merged: `branch_samples` (one sample per prefix-consistent branch), every span encoded;
- after: merged, and each distinct image of a micro-batch encoded once (`Trainer.encode_once`).
Per rollout: tokens forwarded, loss tokens (the same on every side), vision-tower image encodings. Then
the trainer's step time on a widened tiny model (`build_tiny_model(gpu_shape=True)`: hidden 256,
head_dim 128), before and after in this process, median of `--steps` steps after one warm-up, as wall
and as this process's CPU seconds (one torch thread: the CPU figure holds on a shared machine);
checkpoint writes are left out (the same on both sides). Ratios are before / after.

    .venv/bin/python bench/trainer_multiturn.py [--turns 4 10] [--rollouts 4] [--steps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Side:
    samples: list[Any]
    tokens: int  # forwarded by the trainer
    loss_tokens: int
    encodings: int  # images through the vision tower


class ScriptedPool:
    """The replica pool's `generate`, answered locally: rollout 0 of a group replies `next`, the others
    `crop top-left`, each with the end-of-turn token."""

    def __init__(self, tokenizer: Any) -> None:
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.replies = {text: [*tokenizer.encode(text), end] for text in ("next", "crop top-left")}

    async def generate(self, key: str, request: Any) -> tuple[str, Any]:
        from rawmm.contract.engine_api import GenerateResponse

        tokens = self.replies["next" if key.endswith("-r0") else "crop top-left"]
        return "scripted", GenerateResponse(
            token_ids=tokens, logprobs=[-1.0] * len(tokens), finish_reason="stop", weights_version=0
        )


def play_rollouts(renderer: Any, turns: int, rollouts: int) -> list[Any]:
    from rawmm.contract.engine_api import Sampling
    from rawmm.rl.envs import load_environment
    from rawmm.rl.orchestrator.rollout import RolloutId, play

    environment = load_environment("shapes-multiturn", {"views": turns})
    pool = ScriptedPool(renderer.tokenizer)

    async def all_rollouts() -> list[Any]:
        return list(
            await asyncio.gather(
                *(
                    play(
                        environment.episode(index // 2),  # groups of two rollouts share their task
                        RolloutId(1, index // 2, index % 2),
                        renderer=renderer,
                        pool=pool,  # type: ignore[arg-type]
                        sampling=Sampling(max_tokens=8, temperature=1.0),
                        max_turns=turns,
                        run_seed=0,
                    )
                    for index in range(rollouts)
                )
            )
        )

    return asyncio.run(all_rollouts())


def measure(samples: list[Any], micro_batch_tokens: int, *, encode_once: bool) -> Side:
    from rawmm.rl.trainer.packing import pack_samples

    encodings = 0
    for micro in pack_samples(samples, micro_batch_tokens):
        hashes = [image.mm_hash for image in micro.images]
        encodings += len(set(hashes)) if encode_once else len(hashes)
    return Side(
        samples=samples,
        tokens=sum(len(s) for s in samples),
        loss_tokens=sum(sum(s.loss_mask) for s in samples),
        encodings=encodings,
    )


def step_seconds(trainer: Any, samples: list[Any], steps: int, *, encode_once: bool) -> tuple[float, float]:
    """Median wall and CPU seconds of a trainer step on `samples`."""
    from rawmm.rl.samples import RolloutBatch

    trainer.encode_once = encode_once
    wall, cpu = [], []
    for i in range(steps + 1):
        started = time.process_time()
        report = trainer.train_step(RolloutBatch(step=trainer.step + 1, samples=samples))
        if i:  # the first is a warm-up
            wall.append(report.step_seconds)
            cpu.append(time.process_time() - started)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[4, 10])
    parser.add_argument("--rollouts", type=int, default=4, help="in groups of two sharing a task")
    parser.add_argument("--steps", type=int, default=3, help="timed trainer steps per side")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    args = parser.parse_args()

    import torch

    from rawmm.config import RunConfig
    from rawmm.contract import OffloadStore
    from rawmm.rl.orchestrator.rollout import PromptRenderer, branch_samples, turn_samples
    from rawmm.rl.trainer.distributed import DistContext
    from rawmm.rl.trainer.loop import Trainer
    from rawmm.run.tiny import build_tiny_model

    torch.manual_seed(0)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="rawmm-bench-multiturn-"))
    model = build_tiny_model("qwen2_vl", work / "model", gpu_shape=True)
    mbt = args.micro_batch_tokens
    config = RunConfig.from_mapping(
        {
            "model": {"path": str(model), "preset": "qwen2_vl", "processor_backend": "pil"},
            "shared_dir": str(work / "shared"),
            "trainer": {"steps": 10_000, "learning_rate": 1e-6, "seq_len": mbt, "micro_batch_tokens": mbt},
            "monitoring": {"trainer_metrics_port": 0, "orchestrator_metrics_port": 0},
        }
    )
    renderer = PromptRenderer(model, "qwen2_vl", "pil", OffloadStore(config.offload_dir))
    trainer = Trainer(config, DistContext(rank=0, world_size=1, device=torch.device("cpu")))
    trainer._checkpoint = lambda step: work / f"no-checkpoint-{step}"  # type: ignore[method-assign]
    params = sum(p.numel() for p in trainer.model.parameters())
    print(f"widened tiny Qwen2-VL: {params / 1e6:.1f} M params, cpu, {torch.get_num_threads()} threads")
    print(
        f"{args.rollouts} rollouts of shapes-multiturn per step (groups of 2), micro-batches <= {mbt} tokens"
    )
    print(
        "T   side    samples  tokens/rollout  loss tokens/rollout  encodings/rollout  step wall s  step cpu s"
    )
    for turns in args.turns:
        rollouts = play_rollouts(renderer, turns, args.rollouts)
        played = {len(r.turns) for r in rollouts}
        assert played == {turns}, f"rollouts ended early: {played}"
        per_turn = [s for r in rollouts for s in turn_samples(r, 1.0, renderer.placeholder_id)]
        branches = [s for r in rollouts for s in branch_samples(r, 1.0, renderer.placeholder_id)]
        before = measure(per_turn, mbt, encode_once=False)
        merged = measure(branches, mbt, encode_once=False)
        after = measure(branches, mbt, encode_once=True)
        assert before.loss_tokens == after.loss_tokens  # every sampled token is trained on, once
        timed = {
            "before": step_seconds(trainer, per_turn, args.steps, encode_once=False),
            "after": step_seconds(trainer, branches, args.steps, encode_once=True),
        }
        n = args.rollouts
        for name, side in (("before", before), ("merged", merged), ("after", after)):
            wall, cpu = (f"{v:>11.3f}" for v in timed[name]) if name in timed else ("", "")
            print(
                f"{turns:<3} {name:<7} {len(side.samples):>7}  {side.tokens / n:>14.0f}  "
                f"{side.loss_tokens / n:>19.0f}  {side.encodings / n:>17.1f}  {wall:>11}  {cpu:>10}"
            )
        (wall_b, cpu_b), (wall_a, cpu_a) = timed["before"], timed["after"]
        print(
            f"T={turns}: tokens {before.tokens / after.tokens:.2f}x fewer (~T/2 = {turns / 2:.1f}); encodings "
            f"{before.encodings / merged.encodings:.2f}x fewer merged ((T+1)/2 = {(turns + 1) / 2:.1f}), "
            f"{before.encodings / after.encodings:.2f}x with each image once per micro-batch; step "
            f"{wall_b / wall_a:.2f}x faster wall, {cpu_b / cpu_a:.2f}x cpu; rollouts per cpu-second "
            f"{n / cpu_b:.2f} -> {n / cpu_a:.2f}"
        )


if __name__ == "__main__":
    main()
