"""What FSDP2 shards and in which precision; the settings as a user writes them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText

from rawmm.config import ConfigError, RunConfig
from rawmm.rl.trainer.fsdp import shard_units
from rawmm.rl.trainer.precision import mixed_precision_policy


@pytest.mark.parametrize("fixture", ["tiny_qwen2_vl", "tiny_qwen3_vl"])
def test_units_are_each_layer_each_vision_block_the_tower_and_the_root(fixture, request):
    model = AutoModelForImageTextToText.from_pretrained(request.getfixturevalue(fixture))
    inner = model.model
    units = shard_units(model)
    assert units[-1] is model and units[-2] is inner.visual
    layers, blocks = list(inner.language_model.layers), list(inner.visual.blocks)
    assert len(layers) >= 2 and len(blocks) >= 2
    assert {id(u) for u in units[:-2]} == {id(m) for m in layers + blocks}
    # Innermost first: fully_shard on a parent must come after its children.
    assert len(units) == len({id(u) for u in units}) == len(layers) + len(blocks) + 2


def test_a_model_without_named_layers_cannot_be_sharded():
    with pytest.raises(TypeError, match="names no decoder layers"):
        shard_units(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_gpu_computes_in_bf16_and_reduces_in_fp32_cpu_stays_fp32():
    gpu = mixed_precision_policy(torch.device("cuda", 0))
    assert (gpu.param_dtype, gpu.reduce_dtype) == (torch.bfloat16, torch.float32)
    cpu = mixed_precision_policy(torch.device("cpu"))
    assert (cpu.param_dtype, cpu.reduce_dtype) == (None, None)


def config(**trainer: object) -> RunConfig:
    return RunConfig.from_mapping(
        {"model": {"path": "m", "preset": "qwen2_vl"}, "shared_dir": "/s", "trainer": trainer}
    )


def test_parallelism_and_checkpointing_settings():
    assert (config().trainer.parallelism, config().trainer.activation_checkpointing) == ("ddp", False)
    chosen = config(parallelism="fsdp", activation_checkpointing=True).trainer
    assert (chosen.parallelism, chosen.activation_checkpointing) == ("fsdp", True)
    with pytest.raises(ConfigError, match="trainer.parallelism: Input should be 'ddp' or 'fsdp'"):
        config(parallelism="tensor")


def test_the_rlrun_spec_carries_the_settings_to_the_trainer():
    from rawmm_operator.spec import RLRunSpec, run_config

    spec = RLRunSpec.model_validate(
        {
            "model": {"name": "m", "preset": "qwen2_vl"},
            "trainer": {"parallelism": "fsdp", "activationCheckpointing": True},
        }
    )
    trainer = run_config("run", "ns", spec).trainer
    assert (trainer.parallelism, trainer.activation_checkpointing) == ("fsdp", True)
