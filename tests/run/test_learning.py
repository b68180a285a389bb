"""The loop learns: a short `rawmm run` of the tiny model on `colours` (K = 4 flat colours, so a policy that
ignores the pixels scores at most 0.25) ends well above that blind ceiling, through the whole product path
(raw refs, engine cache, orchestrator, trainer, weight sync), and writes its report from its own numbers.

This test fails when learning breaks; to see it fail, run it with learning sabotaged in every process:

    RAWMM_SABOTAGE=negate-advantages .venv/bin/pytest tests/run/test_learning.py
    RAWMM_SABOTAGE=no-weight-reload .venv/bin/pytest tests/run/test_learning.py

(bench/learning.py runs the longer version, the constant-image control and the vLLM engine.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from ports import free_port

from rawmm.config import RunConfig
from rawmm.run import LocalRun, plan_local_run
from rawmm.run.report import REPORT_NAME, load_run

EXAMPLE = Path(__file__).parents[2] / "examples" / "local-tiny-learning.yaml"
SABOTAGE = Path(__file__).parent / "sabotage"
STEPS = 20
# More than twice the blind ceiling 0.25, ~15 standard deviations of a 3-step mean above it (128 rollouts a
# step: ~0.038 per step, ~0.022 over 3), and 0.2 below where this run stands after 20 steps (0.80 over steps
# 18-20, measured): a policy that learned nothing from the pixels stays within noise of 0.25 or below.
PASS_MARK = 0.6


def learning_config() -> RunConfig:
    """The demo's learning run, shortened."""
    data = yaml.safe_load(EXAMPLE.read_text())
    data["inference"]["base_port"] = free_port()
    data["trainer"]["steps"] = STEPS
    return RunConfig.model_validate(data)


@pytest.mark.slow
@pytest.mark.timeout(600)  # ~2 min on 2 quiet cores; shared cores take several times longer
def test_reward_rises_past_the_blind_ceiling_and_the_report_shows_it(tmp_path, monkeypatch):
    if os.environ.get("RAWMM_SABOTAGE"):
        monkeypatch.setenv(
            "PYTHONPATH", os.pathsep.join(filter(None, [str(SABOTAGE), os.environ.get("PYTHONPATH")]))
        )
    run = LocalRun(plan_local_run(learning_config(), output_dir=tmp_path / "run"))
    summary = run.run()

    rewards = summary["reward_mean"]
    assert len(rewards) == STEPS
    assert rewards[0] < 0.3, (
        f"the warmed-up policy should start at or below the blind ceiling 0.25: {rewards}"
    )
    last = sum(rewards[-3:]) / 3
    assert last > PASS_MARK, f"mean reward of the last 3 steps {last:.3f} <= {PASS_MARK}: {rewards}"
    # The engines served the trained weights: one load per checkpoint.
    assert list(summary["engine_weights_version"].values()) == [STEPS]

    # The report was written at the end, from these numbers.
    assert run.report_path == tmp_path / "run" / REPORT_NAME
    record = load_run(tmp_path / "run")
    assert record.rewards() == rewards
    assert record.blind_ceiling == 0.25
    assert [row.loss for row in record.steps] == summary["loss"]
    text = run.report_path.read_text()
    assert "beats the blind ceiling" in text and f"{last:.3f}" in text
    timeline = [json.loads(line) for line in (tmp_path / "run" / "timeline.jsonl").read_text().splitlines()]
    assert {t["step"] for t in timeline} == set(range(1, STEPS + 1))
