"""One precision policy on any number of ranks: bf16 compute on GPU over fp32 weights, gradients and
AdamW state; fp32 on CPU."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from rawmm.config import RunConfig
from rawmm.rl.samples import RolloutBatch
from rawmm.rl.trainer.distributed import DistContext
from rawmm.rl.trainer.loop import Trainer
from rawmm.rl.trainer.precision import STATE_BYTES_PER_PARAM, autocast, compute_dtype, mixed_precision_policy

GPU, CPU = torch.device("cuda", 0), torch.device("cpu")


def test_gpu_computes_in_bf16_whether_sharded_or_not_and_cpu_in_fp32():
    assert (compute_dtype(GPU), compute_dtype(CPU)) == (torch.bfloat16, torch.float32)
    sharded = mixed_precision_policy(GPU)
    assert (sharded.param_dtype, sharded.reduce_dtype) == (torch.bfloat16, torch.float32)
    unsharded = autocast(GPU)
    assert isinstance(unsharded, torch.autocast) and unsharded.fast_dtype == torch.bfloat16
    assert not isinstance(autocast(CPU), torch.autocast)
    assert STATE_BYTES_PER_PARAM == 16  # fp32 weight, gradient and two AdamW moments


@pytest.mark.gpu  # bf16 compute is the GPU's policy
def test_a_one_gpu_run_computes_in_bf16_and_keeps_fp32_state(make_config: Callable[..., RunConfig], rollouts):
    trainer = Trainer(make_config(), DistContext(rank=0, world_size=1, device=GPU))
    assert not trainer.sharded
    seen: set[torch.dtype] = set()
    head = trainer.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda module, args, out: seen.add(out.dtype))
    trainer.train_step(RolloutBatch(step=1, samples=rollouts.standard_batch()))
    hook.remove()
    assert seen == {torch.bfloat16}
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    moments = [t for state in trainer.optimizer.state.values() for k, t in state.items() if k != "step"]
    assert moments and {t.dtype for t in moments} == {torch.float32}
    assert all(group["fused"] for group in trainer.optimizer.param_groups)  # one kernel for every parameter
