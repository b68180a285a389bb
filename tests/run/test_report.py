"""The run report: built from a run directory's own numbers (step lines, timeline, summary), with every plot,
and rebuilt by `rawmm report` for a run that is still going."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
import yaml

from rawmm.cli import main
from rawmm.run.report import REPORT_NAME, build_report, load_run
from rawmm.run.report.data import TIMELINE_NAME
from rawmm.run.report.plots import FIGURES

REWARDS = [0.25, 0.3, 0.6, 0.9, 0.95]


def fake_run(run_dir: Path, *, steps: int = len(REWARDS), finished: bool = True) -> Path:
    """A run directory as `rawmm run` leaves it: config, step lines among other log lines, timeline."""
    (run_dir / "logs").mkdir(parents=True)
    config = {
        "name": "fake",
        "model": {"path": "/m", "preset": "qwen2_vl"},
        "inference": {"engine": "transformers", "replicas": 1},
        "orchestrator": {"environment": {"name": "colours", "args": {"colours": 4}}, "max_turns": 1},
        "trainer": {"steps": len(REWARDS), "learning_rate": 0.002},
    }
    (run_dir / "run-config.yaml").write_text(yaml.safe_dump(config))
    orchestrator, trainer, timeline = ["INFO starting"], ["Loading weights..."], []
    for step, reward in enumerate(REWARDS[:steps], start=1):
        orchestrator.append(json.dumps({
            "event": "orchestrator_step", "step": step, "reward_mean": reward, "rollout_seconds": 2.0 + step,
            "sync_seconds": 0.5, "reward_by_label": {"red": reward, "blue": reward / 2},
        }))  # fmt: skip
        trainer.append(json.dumps({
            "event": "trainer_step", "step": step, "loss": -0.1 * step, "grad_norm": 0.5 / step,
            "logprob_diff_mean": 1e-3 * step, "logprob_kl_mean": 1e-6 * step, "step_seconds": 4.0,
            "materialize_seconds": 1.0,
        }))  # fmt: skip
        # cumulative counters: step 1 all misses, then 3 hits per miss
        timeline.append({"event": "orchestrator_step", "step": step, "elapsed_seconds": 10.0 * step,
                         "cache_hits": 3 * (step - 1) * 4, "cache_misses": 4 * step})  # fmt: skip
    (run_dir / "logs" / "orchestrator.log").write_text("\n".join(orchestrator) + "\n")
    (run_dir / "logs" / "trainer.log").write_text("\n".join(trainer) + "\n")
    (run_dir / TIMELINE_NAME).write_text("".join(json.dumps(t) + "\n" for t in timeline))
    if finished:
        (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "wall_seconds": 61.0}))
    return run_dir


def test_the_record_holds_the_run_s_own_numbers(tmp_path):
    record = load_run(fake_run(tmp_path / "run"))
    assert record.rewards() == REWARDS
    assert record.blind_ceiling == 0.25  # from the colours environment the config names
    assert [row.cache_hit_rate for row in record.steps] == [0.0, 0.75, 0.75, 0.75, 0.75]
    assert [row.train_seconds for row in record.steps] == [3.0] * 5
    assert record.last_mean(3) == pytest.approx((0.6 + 0.9 + 0.95) / 3)
    above = record.first_above_ceiling()
    assert above is not None and (above.step, above.elapsed_seconds) == (2, 20.0)


def test_the_report_is_one_self_contained_file_with_every_plot(tmp_path):
    run_dir = fake_run(tmp_path / "run")
    path = build_report(run_dir)
    assert path == run_dir / REPORT_NAME
    text = path.read_text()
    embedded = re.findall(r"src='data:image/png;base64,([^']+)'", text)
    assert len(embedded) == len(FIGURES)
    for (name, _, _), data in zip(FIGURES, embedded, strict=True):
        png = (run_dir / "plots" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and base64.b64decode(data) == png
    assert "http" not in text.replace("http://www.w3.org", "")  # nothing fetched when opened
    assert "beats the blind ceiling" in text and "0.8167" in text  # last-3 mean of the fake rewards
    for reward in REWARDS:
        assert f"<td>{reward:.4g}</td>" in text


def test_rawmm_report_rebuilds_a_live_run_and_refuses_other_directories(tmp_path, capsys):
    run_dir = fake_run(tmp_path / "run", steps=2, finished=False)
    assert main(["report", str(run_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(run_dir / REPORT_NAME)
    text = (run_dir / REPORT_NAME).read_text()
    assert "running (no summary.json yet)" in text and "2 of 5" in text
    assert main(["report", str(tmp_path)]) == 2
    assert "no rawmm run output directory" in capsys.readouterr().err
