"""`rawmm run` with the tiny Kimi K2.5 (examples/local-kimi.yaml) on the transformers engine: every image
travels as a `vision_chunk` raw ref, later turns hit the engine's cache, the trainer trains on position ids
and the engine serves each checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ports import free_port

from rawmm.config import RunConfig
from rawmm.run import LocalRun, plan_local_run

EXAMPLE = Path(__file__).parents[2] / "examples" / "local-kimi.yaml"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_steps_of_kimi_with_cache_hits_and_no_invalid_refs(tmp_path: Path) -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["inference"]["base_port"] = free_port()
    # Smaller than the example (CPU time), still multi-turn: turn 2 and 3 resend the earlier images.
    data["orchestrator"].update(prompts_per_step=1, rollouts_per_prompt=2, max_tokens=8)
    summary = LocalRun(plan_local_run(RunConfig.model_validate(data), output_dir=tmp_path / "run")).run()
    assert summary["status"] == "completed" and summary["steps_completed"] == 2, summary.get("error")
    assert summary["invalid_mm_image_refs"] == 0
    assert summary["cache_hits"] > 0 and summary["cache_misses"] > 0
    assert summary["images_materialized_trainer"] > 0 and summary["missing_images_trainer"] == 0
    assert list(summary["engine_weights_version"].values()) == [2]  # each checkpoint reloaded
    assert all(loss == loss for loss in summary["loss"])  # finite (NaN != NaN)


def test_the_kimi_examples_are_valid_run_configs() -> None:
    for name in ("local-kimi.yaml", "local-kimi-vllm.yaml"):
        config = RunConfig.model_validate(yaml.safe_load((EXAMPLE.parent / name).read_text()))
        assert (config.model.path, config.model.preset) == ("tiny:kimi_k25", "kimi_k25")
        assert config.model.processor_backend == "pil"  # what vLLM's own Kimi path runs
