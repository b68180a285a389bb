"""`rawmm run` with `trainer.weight_transfer: broadcast`: the trainer puts each step's weights into the engine
itself (no checkpoint reload), and at the end the engine serves, bit for bit, what a reload of the trainer's
last checkpoint serves."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from test_local import assert_all_stopped, e2e_config

from rawmm.contract.engine_api import GENERATE_PATH, WEIGHTS_PATH
from rawmm.contract.shared_dir import checkpoint_dir, checkpoint_steps
from rawmm.contract.weights_token import WEIGHTS_TOKEN_ENV
from rawmm.run import LocalRun, LocalRunPlan, plan_local_run
from rawmm.run.scrape import health_version

PROMPT = [5, 9, 13, 17, 21, 25]
SAMPLING = {"max_tokens": 8, "temperature": 1.0, "seed": 3, "logprobs": True}


def generate(http: httpx.Client, url: str) -> dict[str, Any]:
    response = http.post(f"{url}{GENERATE_PATH}", json={"prompt_token_ids": PROMPT, "sampling": SAMPLING})
    assert response.status_code == 200, response.text
    return dict(response.json())


class ReloadComparison:
    """Run as `LocalRun(on_finished=...)`, before anything is stopped: what the engine at `url` serves as the
    run left it (and its weights version), then what it serves after reloading each checkpoint written."""

    def __init__(self, plan: LocalRunPlan) -> None:
        (self.url,) = plan.config.inference.urls
        self.checkpoints = plan.config.checkpoints_dir
        self.seen: dict[str, Any] = {}

    def __call__(self, run: LocalRun) -> None:
        headers = {"Authorization": f"Bearer {run._weights_env[WEIGHTS_TOKEN_ENV]}"}
        with httpx.Client(timeout=300) as http:
            self.seen["version"] = health_version(http, self.url)
            self.seen["served"] = generate(http, self.url)
            for step in checkpoint_steps(self.checkpoints):
                body = {"path": str(checkpoint_dir(self.checkpoints, step).resolve())}
                loaded = http.post(f"{self.url}{WEIGHTS_PATH}", json=body, headers=headers)
                assert loaded.status_code == 200, loaded.text
                self.seen[f"step_{step}"] = generate(http, self.url)


def assert_broadcasts_to_the_last_weights(
    run: LocalRun, summary: dict[str, Any], plan: LocalRunPlan, seen: dict[str, Any], steps: int = 2
) -> None:
    """Every step's weights went by broadcast, and the engine serves what the last step's checkpoint serves."""
    assert summary["status"] == "completed" and summary["steps_completed"] == steps, summary["error"]
    trained = run.state.trainer_steps
    assert [trained[s]["weights_delivery"] for s in range(1, steps + 1)] == ["broadcast"] * steps
    assert all(trained[s]["weights_seconds"] > 0 for s in range(1, steps + 1))
    # Every update moved the version, all broadcasts: the orchestrator told the engine to load nothing.
    assert seen["version"] == steps
    assert "replicas now serve checkpoint" not in run.orchestrator.log_path.read_text()
    assert plan.config.weights_step_path.read_text() == f"{steps}\n"
    served, last, previous = seen["served"], seen[f"step_{steps}"], seen[f"step_{steps - 1}"]
    assert (served["token_ids"], served["logprobs"]) == (last["token_ids"], last["logprobs"])
    # ... and the comparison can tell the steps apart: the weights did move.
    assert previous["logprobs"] != last["logprobs"]


@pytest.mark.slow
def test_a_broadcast_run_ends_with_the_engine_serving_the_trainers_last_weights(tmp_path, tiny_qwen2_vl):
    # Weight decay moves the weights even on a step whose rewards are all equal (no policy gradient).
    trainer = {
        "steps": 3,
        "weight_transfer": "broadcast",
        "checkpoint_every": 2,
        "learning_rate": 1e-3,
        "weight_decay": 0.1,
    }
    config = e2e_config(tiny_qwen2_vl, trainer=trainer)
    plan = plan_local_run(config, output_dir=tmp_path)
    comparison = ReloadComparison(plan)
    run = LocalRun(plan, on_finished=comparison)
    summary = run.run()
    assert_all_stopped(run)

    assert_broadcasts_to_the_last_weights(run, summary, plan, comparison.seen, steps=3)
    # Step 2 was sampled with step 1's weights, as in checkpoint mode.
    assert run.state.orchestrator_steps[2]["weights_step"] == 1
    # Checkpoints every 2 steps and at the last (resume, catch-up of a replica that missed an update); the
    # engines never read step 1's: it went by broadcast alone.
    assert checkpoint_steps(plan.config.checkpoints_dir) == [2, 3]
    assert [run.state.trainer_steps[s]["checkpoint"] is None for s in (1, 2, 3)] == [True, False, False]
