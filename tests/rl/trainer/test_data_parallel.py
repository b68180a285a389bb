"""Two data-parallel ranks (torchrun, gloo on CPU) must make the same update as one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from rawmm.rl.packing import pack_samples
from rawmm.rl.trainer.checkpoint import checkpoint_dir
from rawmm.rl.trainer.distributed import init_distributed
from rawmm.rl.trainer.loop import Trainer


@pytest.mark.slow
def test_two_ranks_make_the_same_update_as_one(rollouts, make_config, tmp_path):
    config = make_config(seq_len=64, micro_batch_tokens=64)
    samples = rollouts.standard_batch()
    # Several micro-batches, an odd number: the ranks get unequal shares.
    assert len(pack_samples(samples, 64)) % 2 == 1 and len(pack_samples(samples, 64)) >= 3
    rollouts.write(1, samples)

    [single] = Trainer(config, init_distributed()).run(1, batch_timeout=5)
    base = load_file(rollouts.config.model.path + "/model.safetensors")
    single_weights = load_file(checkpoint_dir(config.checkpoints_dir, 1) / "model.safetensors")
    config.checkpoints_dir.rename(tmp_path / "single-process-checkpoints")  # the DP run starts from the base

    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*torchrun, "-m", "rawmm.cli", "train", str(config_file), "--steps", "1", "--batch-timeout", "30"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [parallel] = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"')]

    assert parallel["loss_tokens"] == single.loss_tokens
    assert parallel["images"] == single.images  # summed over ranks (each rank dedupes its own share)
    assert parallel["loss"] == pytest.approx(single.loss, abs=1e-6)
    assert parallel["grad_norm"] == pytest.approx(single.grad_norm, rel=1e-5)
    parallel_weights = load_file(checkpoint_dir(config.checkpoints_dir, 1) / "model.safetensors")
    assert parallel_weights.keys() == single_weights.keys()
    # AdamW's first step moves every weight by about lr * sign(grad), so a gradient that is wrong in
    # any element shows as a difference of ~lr there. Gradient elements near AdamW's eps differ by
    # float summation order alone; 5% of lr leaves room for that and for nothing else.
    lr = config.trainer.learning_rate
    moved = max((t - base[name]).abs().max().item() for name, t in single_weights.items())
    assert moved == pytest.approx(lr, rel=1e-3)
    for name, tensor in single_weights.items():
        torch.testing.assert_close(parallel_weights[name], tensor, rtol=0, atol=0.05 * lr, msg=name)
