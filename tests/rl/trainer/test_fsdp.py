"""FSDP2 on two ranks (torchrun, gloo on CPU) against one process, and against itself without a stop.

One set of runs serves every test here (each torchrun launch costs seconds):
- `single`: one process trains step 1;
- `no_stop`: two FSDP ranks train steps 1-2 in one launch;
- `resumed`: two FSDP ranks train step 1, exit, and a second launch resumes for step 2;
- `checkpointed`: two FSDP ranks train step 1 with activation checkpointing.
Step 1's batch is laid out so that every lockstep case occurs: five micro-batches over two ranks (rank 1
runs a filler alone), a text-only micro-batch next to image ones (filler appended) and a missing
image under `zero_loss`.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
import yaml
from rollout_kit import RolloutFactory, random_image, run_config, torchrun_train
from safetensors.torch import load_file

from rawmm.config import RunConfig
from rawmm.contract.shared_dir import checkpoint_dir, latest_step, train_state_dir
from rawmm.materialize import load_processor
from rawmm.rl.samples import truncate_sample
from rawmm.rl.trainer.distributed import init_distributed
from rawmm.rl.trainer.lockstep import rank_slots
from rawmm.rl.trainer.loop import Trainer
from rawmm.rl.trainer.packing import pack_samples

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # four torchrun launches, once per module
SEQ = 64


@dataclass(frozen=True)
class Runs:
    config: RunConfig
    lines: dict[str, list[dict]]  # run -> its step lines
    checkpoints: dict[str, Path]  # run -> its checkpoints dir


def step1_batch(rollouts: RolloutFactory) -> list:
    samples = rollouts.standard_batch()
    samples.append(
        rollouts.sample([random_image(84, 56, 5), random_image(60, 60, 6)], " two blue", -0.5, "g2-r0")
    )
    samples += [rollouts.sample([], " hello there", 0.25 * i, f"text-{i}") for i in range(4)]
    return samples


@pytest.fixture(scope="module")
def runs(tiny_qwen2_vl: Path, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("fsdp")
    config = run_config(
        tiny_qwen2_vl,
        root / "shared",
        seq_len=SEQ,
        micro_batch_tokens=SEQ,
        missing_image_policy="zero_loss",
        parallelism="fsdp",
    )
    rollouts = RolloutFactory(config)
    samples = step1_batch(rollouts)
    rollouts.delete_image(samples[2].mm_refs[0].uri)  # g1-r0's prompt image, shared with g1-r1
    rollouts.write(1, samples)
    rollouts.write(2, rollouts.standard_batch(seed=7))
    micro_batches = pack_samples([truncate_sample(s, SEQ) for s in samples], SEQ)
    slots = [rank_slots(micro_batches, r, 2, lockstep=True) for r in range(2)]
    assert len(micro_batches) == 5 and [len(s) for s in slots] == [3, 3]
    assert any(s.batch is None for s in slots[1])  # a filler alone
    assert any(s.batch is not None and not s.batch.images and s.filler for s in slots[0] + slots[1])

    checkpoints: dict[str, Path] = {}
    lines: dict[str, list[dict]] = {}

    def keep(name: str) -> None:
        checkpoints[name] = config.checkpoints_dir.rename(root / f"checkpoints-{name}")

    [single] = Trainer(config, init_distributed()).run(1, batch_timeout=5)
    lines["single"] = [asdict(single)]
    keep("single")

    config_file = root / "run.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    lines["no_stop"] = torchrun_train(config_file, 2)
    keep("no_stop")
    lines["resumed"] = torchrun_train(config_file, 1)
    assert latest_step(config.checkpoints_dir) == 1
    lines["resumed"] += torchrun_train(config_file, 2)
    keep("resumed")
    recomputing = config.model_copy(
        update={"trainer": config.trainer.model_copy(update={"activation_checkpointing": True})}
    )
    config_file.write_text(yaml.safe_dump(recomputing.model_dump(mode="json")))
    lines["checkpointed"] = torchrun_train(config_file, 1)
    keep("checkpointed")
    return Runs(config, lines, checkpoints)


def weights(runs: Runs, name: str, step: int) -> dict[str, torch.Tensor]:
    return load_file(checkpoint_dir(runs.checkpoints[name], step) / "model.safetensors")


@pytest.mark.parametrize("run", ["resumed", "checkpointed"])
def test_one_fsdp_step_makes_the_same_update_as_one_process(runs, run, tiny_qwen2_vl):
    [single], fsdp = runs.lines["single"], runs.lines[run][0]
    assert fsdp["step"] == 1
    # Packing, zero_loss and dedupe as in one process: the same loss tokens, images and missing images
    # (images are summed over ranks; fillers count nowhere).
    for key in ("loss_tokens", "images", "missing_images", "samples", "tokens"):
        assert fsdp[key] == single[key], key
    assert single["missing_images"] == 2
    assert fsdp["loss"] == pytest.approx(single["loss"], abs=1e-6)
    assert fsdp["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)

    base = load_file(tiny_qwen2_vl / "model.safetensors")
    one, sharded = weights(runs, "single", 1), weights(runs, run, 1)
    assert sharded.keys() == one.keys() == base.keys()
    # As in test_data_parallel: AdamW's first step moves every weight by about lr * sign(grad), so a
    # wrong gradient element shows as ~lr there; 5% of lr leaves room for summation order only.
    lr = runs.config.trainer.learning_rate
    moved = max((t - base[name]).abs().max().item() for name, t in one.items())
    assert moved == pytest.approx(lr, rel=1e-3)
    for name, tensor in one.items():
        torch.testing.assert_close(sharded[name], tensor, rtol=0, atol=0.05 * lr, msg=name)


def test_fsdp_resume_continues_exactly_as_without_a_stop(runs):
    no_stop, resumed = runs.lines["no_stop"], runs.lines["resumed"]
    assert [line["step"] for line in no_stop] == [line["step"] for line in resumed] == [1, 2]
    for key in ("loss", "grad_norm", "loss_tokens", "clipped_fraction", "logprob_diff_mean"):
        assert resumed[1][key] == no_stop[1][key], key
    a, b = weights(runs, "no_stop", 2), weights(runs, "resumed", 2)
    for name, tensor in a.items():
        assert torch.equal(b[name], tensor), name
    # Only the newest checkpoint keeps the resume state.
    assert train_state_dir(runs.checkpoints["resumed"], 2).is_dir()
    assert not train_state_dir(runs.checkpoints["resumed"], 1).exists()


def test_gathered_checkpoint_loads_in_the_transformers_engine(runs, tiny_qwen2_vl, tmp_path):
    from transformers import AutoModelForImageTextToText

    from rawmm.serving.transformers_engine import TransformersEngine

    engine = TransformersEngine(str(tiny_qwen2_vl), load_processor(tiny_qwen2_vl))
    base = {k: v.clone() for k, v in engine.model.state_dict().items()}
    # The engine reads the directory as published (tokenizer, processor, config and weights).
    published = shutil.copytree(checkpoint_dir(runs.checkpoints["resumed"], 2), tmp_path / "step_2")
    try:
        assert asyncio.run(engine.load_weights(str(published))) == 1
        served = engine.model.state_dict()
    finally:
        asyncio.run(engine.close())
    # It serves the trained weights: those of the run that never stopped, not the base model's.
    trained = AutoModelForImageTextToText.from_pretrained(
        checkpoint_dir(runs.checkpoints["no_stop"], 2), dtype=torch.float32
    ).state_dict()
    assert served.keys() == trained.keys()
    for name, tensor in trained.items():
        assert torch.equal(served[name], tensor), name
    assert all(not torch.equal(served[name], base[name]) for name in served if name.endswith("q_proj.weight"))
