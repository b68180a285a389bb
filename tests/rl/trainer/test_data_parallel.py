"""Two data-parallel ranks (torchrun, gloo on CPU) must make the same updates as one process, also
across a stop: the second launch resumes with the first one's AdamW state. The second step has no image,
so the vision tower has no gradient there: one process leaves it alone, and so must the ranks."""

from __future__ import annotations

import pytest
import torch
import yaml
from rollout_kit import torchrun_train
from safetensors.torch import load_file

from rawmm.contract.shared_dir import checkpoint_dir
from rawmm.rl.trainer.distributed import init_distributed
from rawmm.rl.trainer.loop import Trainer
from rawmm.rl.trainer.packing import pack_samples

TEXT_ONLY = ((" hello there", 1.0), (" bye now", -1.0), (" what", 0.5))


@pytest.mark.slow
def test_two_ranks_make_the_same_updates_as_one_also_after_a_resume(rollouts, make_config, tmp_path):
    config = make_config(seq_len=64, micro_batch_tokens=64)
    samples = rollouts.standard_batch()
    # Several micro-batches, an odd number: the ranks get unequal shares.
    assert len(pack_samples(samples, 64)) % 2 == 1 and len(pack_samples(samples, 64)) >= 3
    rollouts.write(1, samples)
    text_only = [rollouts.sample([], text, reward, f"t{i}") for i, (text, reward) in enumerate(TEXT_ONLY)]
    rollouts.write(2, text_only)

    single = Trainer(config, init_distributed()).run(2, batch_timeout=5)
    single_dir = config.checkpoints_dir.rename(
        tmp_path / "single-process-checkpoints"
    )  # DP starts from the base

    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    parallel = []
    for steps in (1, 2):  # the second launch resumes
        [line] = torchrun_train(config_file, steps)
        parallel.append(line)

    base = load_file(rollouts.config.model.path + "/model.safetensors")
    lr = config.trainer.learning_rate
    for step in (1, 2):
        one, two = single[step - 1], parallel[step - 1]
        assert two["step"] == step and two["loss_tokens"] == one.loss_tokens
        assert two["images"] == one.images  # summed over ranks (each rank dedupes its own share)
        assert two["loss"] == pytest.approx(one.loss, abs=1e-6)
        assert two["grad_norm"] == pytest.approx(one.grad_norm, rel=1e-5)
        single_weights = load_file(checkpoint_dir(single_dir, step) / "model.safetensors")
        parallel_weights = load_file(checkpoint_dir(config.checkpoints_dir, step) / "model.safetensors")
        assert parallel_weights.keys() == single_weights.keys() == base.keys()
        # An AdamW step moves every weight by at most about lr (exactly lr * sign(grad) on the first), so a
        # wrong gradient element or optimizer moment shows as a difference of ~lr there. Gradient elements
        # near AdamW's eps differ by float summation order alone; 5% of lr leaves room for that only.
        if step == 1:
            moved = max((t - base[name]).abs().max().item() for name, t in single_weights.items())
            assert moved == pytest.approx(lr, rel=1e-3)
        for name, tensor in single_weights.items():
            torch.testing.assert_close(parallel_weights[name], tensor, rtol=0, atol=0.05 * lr, msg=name)
